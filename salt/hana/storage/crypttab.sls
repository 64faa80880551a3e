# -*- coding: utf-8 -*-
# vim: ft=sls
# /etc/crypttab by LUKS UUID, with the options that reproduce the dm-crypt flags at boot: only for
# a device whose flags are stored, i.e. whose content the guard accepted (luks.sls).
# Tang volumes (key file "none", _netdev) unlock at boot through Clevis's password agent once
# the network is up: its path unit and remote-cryptsetup.target are enabled.
# A key rotation (key:previous) ends here: once crypttab names the new key, the previous key's
# keyslots are removed, so a boot at any point of it unlocks with the key crypttab names.
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   for name, volume in hana_storage.config.volumes | dictsort if not volume.moving %}
{%-     for crypt in volume.crypt %}

hana-storage-{{ name }}-crypttab-{{ loop.index0 }}:
  hana_storage.crypttab_present:
    - name: {{ crypt.name }}
    - device: {{ crypt.device }}
    - key_file: {{ volume.key.crypttab }}
    - options: {{ volume.crypttab_options | json }}
    - require:
      - hana_storage: hana-storage-{{ name }}-flags-{{ loop.index0 }}
{%-       if volume.key.previous %}

hana-storage-{{ name }}-retire-{{ loop.index0 }}:
  hana_storage.previous_key_removed:
    - name: {{ crypt.device }}
    - key_file: {{ volume.key.file }}
    - previous_key_file: {{ volume.key.previous.file }}
{%-       if volume.key.store == 'pillar' %}
    - key_pillar: {{ volume.key.pillar }}
{%-       endif %}
{%-       if volume.key.previous.store == 'pillar' %}
    - previous_key_pillar: {{ volume.key.previous.pillar }}
{%-       endif %}
    - require:
      - hana_storage: hana-storage-{{ name }}-crypttab-{{ loop.index0 }}
{%-       endif %}
{%-     endfor %}
{%-   endfor %}
{%-   set clevis = hana_storage.config.volumes.values() | selectattr('key.clevis') | list %}
{%-   if clevis %}
{%-     set tang = clevis | selectattr('key.source', 'equalto', 'tang') | list %}

hana-storage-unlock-at-boot:
  hana_storage.units_enabled:
    - name: Clevis unlock at boot
    - units: {{ (['clevis-luks-askpass.path'] + (['remote-cryptsetup.target'] if tang else [])) | json }}
    - require:
      - hana_storage: hana-storage-pillar-valid
{%-   endif %}
{%- endif %}
