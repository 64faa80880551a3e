# -*- coding: utf-8 -*-
# vim: ft=sls
# One state per distinct key: a pillar key goes to a ramfs (0400), a key file is made root-only.
# While a key is rotated (key:previous), the previous key is made available the same way.
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
    - pillar_path: {{ key.pillar }}
    - require:
      - hana_storage: hana-storage-pillar-valid
{%-     if key.previous %}

hana-storage-key-{{ id }}-previous:
  hana_storage.key_present:
    - name: {{ key.previous.file }}
    - source: {{ key.previous.store }}
    - pillar_path: {{ key.previous.pillar }}
    - require:
      - hana_storage: hana-storage-pillar-valid
{%-     endif %}
{%-   endfor %}
{%- endif %}
