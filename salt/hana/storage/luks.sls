# -*- coding: utf-8 -*-
# vim: ft=sls
# LUKS2 format and open: on the LV (above LVM) or on each disk (below). A volume installed
# unencrypted, with encrypt_in_place, is encrypted where it is first: above LVM by in-place;
# below LVM by moves, its PVs moved onto LUKS PVs by a unit of its own, while every other state
# of the volume waits (map.jinja's "moving"), and one with
# reencrypt_online is re-encrypted online once open (reencrypt-N); while either runs,
# each step that writes a header or a mapping leaves the device alone. Nothing is written to a
# device the key opens before what it holds is known: it is opened without storing the dm-crypt
# flags, then looked inside (below LVM: pv_safe here, before pvcreate wipes; above LVM: the mkfs
# state), and only then does it get a keyslot for a rotated key, a Clevis binding (Tang and TPM2
# volumes; the recovery key's keyslot stays), its flags stored in the header, a crypttab line and, with
# header_backup, a proven header backup. Under FIPS (compliance:fips, or the host's mode) the key's
# keyslots are made PBKDF2-SHA256 before the flags are stored. While the key is rotated
# (key:previous), the previous key's keyslot goes once crypttab names the new key (crypttab.sls).
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   set luks = hana_storage.config.luks %}
{%-   for name, volume in hana_storage.config.volumes | dictsort if volume.moving %}

hana-storage-{{ name }}-moves:
  hana_storage.moved_onto_luks:
    - name: {{ name }}
    - volume: {{ volume | json }}
    - luks: {{ luks | json }}
    - require:
      - hana_storage: hana-storage-key-{{ volume.key.id }}
{%-   endfor %}
{%-   for name, volume in hana_storage.config.volumes | dictsort if not volume.moving %}
{%-     set above = volume.encryption == 'above_lvm' %}
{%-     set may_wipe = volume.may_format | length == volume.devices | length %}
{%-     if volume.encrypt_in_place and above %}

hana-storage-{{ name }}-in-place:
  hana_storage.encrypted_in_place:
    - name: {{ volume.crypt_name }}
    - device: {{ volume.lv_path }}
    - mountpoint: {{ volume.mountpoint }}
    - key_file: {{ volume.key.file }}
    - luks: {{ luks | json }}
    - stripes: {{ volume.stripes }}
    - stripe_kib: {{ volume.stripe_size_kib }}
    - mount_options: {{ volume.mount_options | json }}
    - max_mib_s: {{ hana_storage.config.get('in_place', {}).get('max_mib_s') | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-lv-extended
{%-     endif %}
{%-     for crypt in volume.crypt %}
{%-       set inside = 'mkfs' if above else 'inside-' ~ loop.index0 %}
{%-       set rekeyed = 'rekey-' ~ loop.index0 if volume.key.previous else inside %}
{%-       set bound = 'clevis-' ~ loop.index0 if volume.key.clevis else rekeyed %}
{%-       set converted = 'fips-' ~ loop.index0 if luks.fips else bound %}

hana-storage-{{ name }}-luks-{{ loop.index0 }}:
  hana_storage.luks_formatted:
    - name: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - luks: {{ luks | json }}
    - label: {{ crypt.name }}
    - stripe_kib: {{ volume.stripe_size_kib if above else 0 }}
    - stripes: {{ volume.stripes if above else 1 }}
    - may_wipe: {{ may_wipe }}
{%-       if above %}
    - created_by: hana-storage-{{ name }}-lv
{%-       endif %}
{%-       if volume.key.previous %}
    - previous_key_file: {{ volume.key.previous.file }}
{%-       endif %}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ 'in-place' if volume.encrypt_in_place and above else 'lv-active' if above else 'guard' }}

hana-storage-{{ name }}-open-{{ loop.index0 }}:
  hana_storage.luks_opened:
    - name: {{ crypt.name }}
    - device: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
{%-       if volume.key.previous %}
    - previous_key_file: {{ volume.key.previous.file }}
{%-       endif %}
    - flags: {{ luks.flags | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-luks-{{ loop.index0 }}
{%-       if not above %}

hana-storage-{{ name }}-inside-{{ loop.index0 }}:
  hana_storage.pv_safe:
    - name: /dev/mapper/{{ crypt.name }}
    - vg: {{ volume.vg | json }}
    - lv_dm_name: {{ volume.lv_dm_name }}
    - opened_by: hana-storage-{{ name }}-open-{{ loop.index0 }}
    - require:
      - hana_storage: hana-storage-{{ name }}-open-{{ loop.index0 }}
{%-       endif %}
{%-       if volume.key.previous %}

hana-storage-{{ name }}-rekey-{{ loop.index0 }}:
  hana_storage.key_enrolled:
    - name: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - previous_key_file: {{ volume.key.previous.file }}
{%-         if volume.key.store == 'pillar' %}
    - key_pillar: {{ volume.key.pillar }}
{%-         endif %}
{%-         if volume.key.previous.store == 'pillar' %}
    - previous_key_pillar: {{ volume.key.previous.pillar }}
{%-         endif %}
    - pbkdf: {{ luks.pbkdf | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ inside }}
{%-       endif %}
{%-       if volume.key.clevis %}

hana-storage-{{ name }}-clevis-{{ loop.index0 }}:
  hana_storage.clevis_bound:
    - name: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - policy: {{ volume.key.clevis | json }}
    - reseal: {{ hana_storage.config.get('tpm2_reseal', False) | json }}
    - fips: {{ luks.fips | json }}
    - header_backup: {{ crypt.header_backup | json }}
{%-         if volume.key.previous %}
    - previous_key_file: {{ volume.key.previous.file }}
{%-         endif %}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ rekeyed }}
{%-       endif %}
{%-       if luks.fips %}

hana-storage-{{ name }}-fips-{{ loop.index0 }}:
  hana_storage.fips_keyslots:
    - name: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - pbkdf: {{ luks.pbkdf | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ bound }}
{%-       endif %}
{%-       if volume.reencrypt_online %}

hana-storage-{{ name }}-reencrypt-{{ loop.index0 }}:
  hana_storage.reencrypted_online:
    - name: {{ crypt.name }}
    - device: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - luks: {{ luks | json }}
    - fs_device: {{ ('/dev/mapper/' ~ crypt.name) if above else volume.lv_path }}
    - max_age_days: {{ luks.get('volume_key_max_age_days') | json }}
{%-         set cap = hana_storage.config.get('in_place', {}).get('max_mib_s') %}
    {#- below LVM the PVs' units run side by side: each gets its share of the volume's cap #}
    - max_mib_s: {{ (([(cap // volume.crypt | length) | int, 1] | max) if cap else none) | json }}
    - below_lvm: {{ (not above) | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ converted }}
{%-       endif %}

hana-storage-{{ name }}-flags-{{ loop.index0 }}:
  hana_storage.luks_flags:
    - name: {{ crypt.name }}
    - device: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - flags: {{ luks.flags | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-{{ converted }}
{%-       if above %}

hana-storage-{{ name }}-crypt-grown:
  hana_storage.crypt_grown:
    - name: {{ crypt.name }}
    - device: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - grown_by: hana-storage-{{ name }}-lv-extended
    - require:
      - hana_storage: hana-storage-{{ name }}-flags-{{ loop.index0 }}
      - hana_storage: hana-storage-{{ name }}-lv-extended
{%-       endif %}
{%-       if crypt.header_backup %}

hana-storage-{{ name }}-header-backup-{{ loop.index0 }}:
  hana_storage.header_backed_up:
    - name: {{ crypt.device }}
    - backup: {{ crypt.header_backup }}
    - key_file: {{ volume.key.file }}
{%-         if volume.key.previous %}
    - previous_key_file: {{ volume.key.previous.file }}
{%-         endif %}
    - policy: {{ volume.key.clevis | json }}
    - formatted_by: hana-storage-{{ name }}-luks-{{ loop.index0 }}
    - require:
      - hana_storage: hana-storage-{{ name }}-flags-{{ loop.index0 }}
{%-         if volume.key.previous %}
      - hana_storage: hana-storage-{{ name }}-retire-{{ loop.index0 }}
{%-         endif %}
{%-       endif %}
{%-     endfor %}
{%-   endfor %}
{%- endif %}
