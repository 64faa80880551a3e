"""Render the formula's SLS files and map with Salt's own Jinja, outside a minion."""

import salt.config
import salt.utils.data
import salt.utils.dictupdate
import salt.utils.templates

from tests.conftest import REPO


def render(
    tmp_path, template, os_family, pillar=None, python="/opt/saltstack/salt/bin/python3.10", functions=None
):
    """The SLS ``template`` of salt/hana/storage rendered by Salt's own Jinja, with the file
    client on the checkout, ``pillar`` and the execution functions given (``functions``)."""
    opts = salt.config.minion_config(None)
    opts.update(
        file_client="local",
        file_roots={"base": [str(REPO / "salt")]},
        cachedir=str(tmp_path),
        pillar=pillar or {},
    )
    functions = {
        **(functions or {}),
        "slsutil.merge": lambda a, b: salt.utils.dictupdate.merge(a, b, merge_lists=False),
        "pillar.get": lambda key, default=None: salt.utils.data.traverse_dict_and_list(
            pillar or {}, key, default
        ),
    }
    context = {
        "opts": opts,
        "saltenv": "base",
        "grains": {"os_family": os_family, "pythonexecutable": python},
        "pillar": pillar or {},
        "salt": functions,
    }
    text = (REPO / "salt" / "hana" / "storage" / template).read_text()
    return salt.utils.templates.render_jinja_tmpl(
        text, context, tmplpath=str(REPO / "salt" / "hana" / "storage" / template)
    )
