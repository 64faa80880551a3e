# -*- coding: utf-8 -*-
# vim: ft=sls
# PVs, VG and one striped LV per volume: on the disks (above LVM) or on the opened LUKS devices
# (below LVM). The formula's pv_present, vg_present and lv_present make the PVs, then the VG
# and the LV on the pillar's PVs only; an existing VG or LV grows through vg_extended and
# lv_extended, in the LV's own stripes (_states/hana_storage.py says why not Salt's states). A
# LUN grown in place lends its new size to its PV first (lun_grown).
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   for name, volume in hana_storage.config.volumes | dictsort if not volume.moving %}
{%-     set above = volume.encryption == 'above_lvm' %}
{%-     for pv in volume.pvs %}

hana-storage-{{ name }}-pv-{{ loop.index0 }}:
  hana_storage.pv_present:
    - name: {{ pv }}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ 'guard' if above else 'inside-' ~ loop.index0 }}
{%-     endfor %}

hana-storage-{{ name }}-vg:
  hana_storage.vg_present:
    - name: {{ volume.vg | json }}
    - pvs: {{ volume.pvs | json }}
    - require:
{%-     for pv in volume.pvs %}
      - hana_storage: hana-storage-{{ name }}-pv-{{ loop.index0 }}
{%-     endfor %}

hana-storage-{{ name }}-vg-extended:
  hana_storage.vg_extended:
    - name: {{ volume.vg | json }}
    - pvs: {{ volume.pvs | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-vg

{%-     for pv in volume.pvs %}

hana-storage-{{ name }}-lun-grown-{{ loop.index0 }}:
  hana_storage.lun_grown:
    - name: {{ volume.devices[loop.index0] | json }}
    - pv: {{ pv | json }}
{%-       if not above %}
    - key_file: {{ volume.key.file | json }}
{%-       endif %}
    - require:
      - hana_storage: hana-storage-{{ name }}-vg-extended
{%-       if not above %}
      - hana_storage: hana-storage-{{ name }}-flags-{{ loop.index0 }}
{%-       endif %}
{%-     endfor %}

hana-storage-{{ name }}-lv:
  hana_storage.lv_present:
    - name: {{ volume.lv_path | json }}
    - size: {{ volume.size | json }}
    - stripes: {{ volume.stripes }}
    - stripe_kib: {{ volume.stripe_size_kib }}
    - pvs: {{ volume.pvs | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-vg-extended

hana-storage-{{ name }}-lv-active:
  hana_storage.lv_active:
    - name: {{ volume.lv_path }}
    - require:
      - hana_storage: hana-storage-{{ name }}-lv

hana-storage-{{ name }}-lv-extended:
  hana_storage.lv_extended:
    - name: {{ volume.lv_path }}
    - stripes: {{ volume.stripes }}
    - stripe_kib: {{ volume.stripe_size_kib }}
    - size: {{ volume.size | json }}
    - pvs: {{ volume.pvs | json }}
    - devices: {{ volume.devices | json }}
    - grown_by:
{%-     for pv in volume.pvs %}
      - hana-storage-{{ name }}-lun-grown-{{ loop.index0 }}
{%-     endfor %}
    - require:
      - hana_storage: hana-storage-{{ name }}-lv-active
{%-     for pv in volume.pvs %}
      - hana_storage: hana-storage-{{ name }}-lun-grown-{{ loop.index0 }}
{%-     endfor %}
{%-   endfor %}
{%- endif %}
