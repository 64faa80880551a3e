# -*- coding: utf-8 -*-
# vim: ft=sls
# salt/beacon/<minion>/hana_storage/violation -> the triage runner. The event is only a hint:
# the runner checks the sender's signature, takes auto/manual from the master's rule table,
# applies the cooldown, then runs hana.storage.orch.remediate or fires hana/storage/alert.
---
hana-storage-triage:
  runner.hana_storage.triage:
    - args:
        - tag: {{ tag | json }}
        - data: {{ data | json }}
