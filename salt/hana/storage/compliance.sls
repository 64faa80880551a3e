# -*- coding: utf-8 -*-
# vim: ft=sls
# The compliance beacon, configured from hana:storage:compliance:beacon (salt's beacon.present,
# saved to the minion's beacons.conf; needs a running salt-minion: a masterless salt-call skips
# it), and the SCAP data stream (hana:storage:compliance:scap).
---
{%- from "hana/storage/map.jinja" import hana_storage with context %}
{%- if hana_storage.valid %}
{%-   set beacon = hana_storage.config.compliance.beacon %}
{%-   if salt['config.get']('file_client') == 'local' %}

hana-storage-beacon:
  test.show_notification:
    - text: "masterless run: the hana_storage beacon needs a running salt-minion; not configured"
{%-   elif beacon.enabled %}

hana-storage-beacon:
  beacon.present:
    - name: hana_storage
    - save: true
    - interval: {{ beacon.interval }}
    - full_audit_interval: {{ beacon.full_audit_interval }}
    - uevents: {{ beacon.uevents }}
    - disable_during_state_run: true
    - require:
      - hana_storage: hana-storage-pillar-valid
{%-   else %}

hana-storage-beacon:
  beacon.absent:
    - name: hana_storage
    - save: true
{%-   endif %}
{%-   if hana_storage.config.compliance.scap.enabled %}

# The SCAP data stream SUSE Manager's Audit > OpenSCAP (Salt's openscap.xccdf) evaluates; its
# checks read the audit the beacon records (hana_storage.scap_record).
hana-storage-scap-datastream:
  hana_storage.scap_datastream:
    - name: /usr/share/xml/scap/hana-storage/hana-storage-ds.xml
    - require:
      - hana_storage: hana-storage-pillar-valid
{%-   else %}

hana-storage-scap-datastream:
  file.absent:
    - names:
      - /usr/share/xml/scap/hana-storage/hana-storage-ds.xml
      - /var/lib/hana-storage/audit.status
{%-   endif %}
{%- endif %}
