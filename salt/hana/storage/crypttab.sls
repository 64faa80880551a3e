# -*- coding: utf-8 -*-
# vim: ft=sls
# /etc/crypttab by LUKS UUID, with the options that reproduce the dm-crypt flags at boot.
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   for name, volume in hana_storage.config.volumes | dictsort %}
{%-     for crypt in volume.crypt %}

hana-storage-{{ name }}-crypttab-{{ loop.index0 }}:
  hana_storage.crypttab_present:
    - name: {{ crypt.name }}
    - device: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - options: {{ volume.crypttab_options | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-open-{{ loop.index0 }}
{%-     endfor %}
{%-   endfor %}
{%- endif %}
