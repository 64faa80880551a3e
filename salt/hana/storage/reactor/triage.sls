# -*- coding: utf-8 -*-
# vim: ft=sls
# salt/beacon/<minion>/hana_storage/violation, and .../audit when it lists open findings -> the
# triage runner. The event is only a hint: the runner checks the sender's signature, takes
# auto/manual from the master's rule table, applies the cooldown, then runs
# hana.storage.orch.remediate or fires hana/storage/alert. An audit event reconciles: each
# open finding the master has not handled yet (its violation's reaction was lost) is handled.
---
{%- if tag.endswith('/violation') or data.get('since') %}

hana-storage-triage:
  runner.hana_storage.triage:
    - args:
        - tag: {{ tag | json }}
        - data: {{ data | json }}
{%- endif %}
