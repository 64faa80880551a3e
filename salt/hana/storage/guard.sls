# -*- coding: utf-8 -*-
# vim: ft=sls
# The data-loss guard: every later state of a volume requires its guard, so a device with
# foreign data stops the whole volume before anything on it is touched.
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   for name, volume in hana_storage.config.volumes | dictsort if not volume.moving %}

hana-storage-{{ name }}-guard:
  hana_storage.devices_safe:
    - name: {{ name }}
    - volume: {{ volume | json }}
    - require:
      - hana_storage: hana-storage-key-{{ volume.key.id }}
{%-     if volume.key.previous %}
      - hana_storage: hana-storage-key-{{ volume.key.id }}-previous
{%-     endif %}
{%-   endfor %}
{%- endif %}
