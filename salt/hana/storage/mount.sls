# -*- coding: utf-8 -*-
# vim: ft=sls
# Mounted with the pillar's options, in /etc/fstab by filesystem UUID; grown online with its device.
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   for name, volume in hana_storage.config.volumes | dictsort if not volume.moving %}

hana-storage-{{ name }}-mount:
  hana_storage.mounted:
    - name: {{ volume.mountpoint }}
    - device: {{ volume.fs_device }}
    - options: {{ volume.mount_options | json }}
    - fstab_options: {{ volume.fstab_options | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-mkfs

hana-storage-{{ name }}-fs-grown:
  hana_storage.fs_grown:
    - name: {{ volume.mountpoint }}
    - device: {{ volume.fs_device }}
    - grown_by: hana-storage-{{ name }}-lv-extended
    - require:
      - hana_storage: hana-storage-{{ name }}-mount
{%-     if volume.encryption == 'above_lvm' %}
      - hana_storage: hana-storage-{{ name }}-crypt-grown
{%-     else %}
      - hana_storage: hana-storage-{{ name }}-lv-extended
{%-     endif %}
{%-   endfor %}
{%- endif %}
