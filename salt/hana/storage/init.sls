# -*- coding: utf-8 -*-
# vim: ft=sls
# Encrypted, striped HANA storage from hana:storage. Each step is its own SLS; requisites
# order the steps per volume (LVM before LUKS above LVM, LUKS before LVM below it).
---
include:
  - .packages
  - .validate
  - .keys
  - .guard
  - .luks
  - .lvm
  - .crypttab
  - .filesystem
  - .mount
  - .compliance
