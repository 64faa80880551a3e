# -*- coding: utf-8 -*-
# vim: ft=sls
# One state per distinct key: a pillar key goes to tmpfs (0400), a key file is made root-only.
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   set keys = {} %}
{%-   for volume in hana_storage.config.volumes.values() %}
{%-     do keys.update({volume.key.id: volume.key}) %}
{%-   endfor %}
{%-   for id, key in keys | dictsort %}

hana-storage-key-{{ id }}:
  hana_storage.key_present:
    - name: {{ key.file }}
    - source: {{ key.store }}
    - pillar: {{ key.pillar }}
    - require:
      - hana_storage: hana-storage-pillar-valid
{%-   endfor %}
{%- endif %}
