"""lab/guest_caller.py, the lab's Salt server in the guest: what it keeps between calls to save
time under emulation must never change what a call renders."""

import copy
import sys

import jinja2
import salt.config
import salt.utils.templates

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "lab"))
import guest_caller  # noqa: E402

SLS = """{%- set volumes = pillar.get('volumes', {}) %}
{%- for name, volume in volumes | dictsort %}
hana-storage-{{ name }}:
  test.succeed_without_changes:
    - name: {{ volume.mountpoint }}
{%- endfor %}
"""


def render(source, pillar):
    opts = copy.deepcopy(salt.config.DEFAULT_MINION_OPTS)
    context = {"opts": opts, "saltenv": "base", "salt": {}, "grains": {}, "pillar": pillar}
    return salt.utils.templates.render_jinja_tmpl(source, context, tmplpath="/srv/salt/hana/x.sls")


def test_kept_template_code_renders_as_salt_does_and_compiles_each_source_once(monkeypatch):
    monkeypatch.setattr(jinja2.Environment, "compile", jinja2.Environment.compile)  # restored after
    compiled = []
    original = jinja2.Environment.compile

    def counting(self, source, *args, **kwargs):
        compiled.append(source)
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    pillar = {"volumes": {"data": {"mountpoint": "/hana/data"}, "log": {"mountpoint": "/hana/log"}}}
    fresh = render(SLS, pillar)
    assert "/hana/data" in fresh and "/hana/log" in fresh
    compiled.clear()

    guest_caller.keep_template_code()
    assert render(SLS, pillar) == fresh  # compiled once, into the cache
    assert render(SLS, pillar) == fresh  # from the cache: Salt's environment is a new one
    assert compiled == [SLS]
    other = {"volumes": {"shared": {"mountpoint": "/hana/shared"}}}
    assert "/hana/shared" in render(SLS, other)  # the same code, other data
    edited = SLS.replace("test.succeed_without_changes", "test.nop")
    assert "test.nop" in render(edited, pillar)  # an edited source is compiled anew
    assert compiled == [SLS, edited]


def test_kept_template_code_keys_on_the_environments_syntax(monkeypatch):
    monkeypatch.setattr(jinja2.Environment, "compile", jinja2.Environment.compile)
    guest_caller.keep_template_code()
    source = "<% if x %>[[ x ]]<% endif %>{{ x }}"
    plain = jinja2.Environment().from_string(source).render(x=1)
    custom = jinja2.Environment(
        block_start_string="<%", block_end_string="%>", variable_start_string="[[", variable_end_string="]]"
    )
    assert plain == "<% if x %>[[ x ]]<% endif %>1"
    assert custom.from_string(source).render(x=1) == "1{{ x }}"
    assert jinja2.Environment().from_string(source).render(x=1) == plain
