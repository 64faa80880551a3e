# -*- coding: utf-8 -*-
# vim: ft=sls
---
include:
  - .validate
