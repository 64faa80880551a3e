# -*- coding: utf-8 -*-
# vim: ft=sls
# Every other state of the formula requires this one; an invalid pillar stops here.
---
include:
  - .packages
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if 'hana_storage.settings' in salt %}

hana-storage-pillar-valid:
  hana_storage.pillar_valid:
    - require:
      - sls: hana.storage.packages
{%- else %}

hana-storage-pillar-valid:
  test.fail_without_changes:
    - name: >-
        {{ hana_storage.errors | join('; ') }}. hana.storage.packages installs what the
        formula's modules need; once it has, apply again (the modules load at the next run).
{%- endif %}
