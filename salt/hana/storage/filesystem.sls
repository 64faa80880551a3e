# -*- coding: utf-8 -*-
# vim: ft=sls
# XFS aligned to the stripe; an existing XFS is never formatted again.
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   for name, volume in hana_storage.config.volumes | dictsort if not volume.moving %}
{%-     set above = volume.encryption == 'above_lvm' %}

hana-storage-{{ name }}-mkfs:
  hana_storage.formatted:
    - name: {{ volume.fs_device }}
    - stripe_kib: {{ volume.stripe_size_kib }}
    - stripes: {{ volume.stripes }}
    - mkfs_options: {{ volume.mkfs_options | json }}
    - may_wipe: {{ volume.may_format | length == volume.devices | length }}
{%-     if above %}
    - opened_by: hana-storage-{{ name }}-open-0
{%-     else %}
    - created_by: hana-storage-{{ name }}-lv
{%-     endif %}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ 'open-0' if above else 'lv-active' }}
{%-   endfor %}
{%- endif %}
