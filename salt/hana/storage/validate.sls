# -*- coding: utf-8 -*-
# vim: ft=sls
# Every other state of the formula requires this one; an invalid pillar stops here.
---
hana-storage-pillar-valid:
  hana_storage.pillar_valid: []
