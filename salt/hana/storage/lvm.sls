# -*- coding: utf-8 -*-
# vim: ft=sls
# PVs, VG and one striped LV per volume (Salt's lvm states): on the disks (above LVM) or on
# the opened LUKS devices (below LVM).
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   for name, volume in hana_storage.config.volumes | dictsort %}
{%-     set above = volume.encryption == 'above_lvm' %}
{%-     for pv in volume.pvs %}

hana-storage-{{ name }}-pv-{{ loop.index0 }}:
  lvm.pv_present:
    - name: {{ pv }}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ 'guard' if above else 'inside-' ~ loop.index0 }}
{%-     endfor %}

hana-storage-{{ name }}-vg:
  lvm.vg_present:
    - name: {{ volume.vg }}
    - devices: {{ volume.pvs | json }}
    - require:
{%-     for pv in volume.pvs %}
      - lvm: hana-storage-{{ name }}-pv-{{ loop.index0 }}
{%-     endfor %}

hana-storage-{{ name }}-lv:
  lvm.lv_present:
    - name: {{ volume.lv }}
    - vgname: {{ volume.vg }}
{%-     if '%' in volume.size %}
    - extents: {{ volume.size }}
{%-     else %}
    - size: {{ volume.size }}
{%-     endif %}
{%-     if volume.stripes > 1 %}
    - stripes: {{ volume.stripes }}
    - stripesize: {{ volume.stripe_size_kib }}k
{%-     endif %}
    - require:
      - lvm: hana-storage-{{ name }}-vg

hana-storage-{{ name }}-lv-active:
  hana_storage.lv_active:
    - name: {{ volume.lv_path }}
    - require:
      - lvm: hana-storage-{{ name }}-lv
{%-   endfor %}
{%- endif %}
