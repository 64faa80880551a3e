# -*- coding: utf-8 -*-
# vim: ft=sls
# cryptsetup, LVM, XFS tools, device-mapper, multipath and fio for this distribution, and the
# Python libraries the formula's modules need in the Python that runs Salt.
---
{%- from "hana/storage/packages.jinja" import packages with context %}
{%- if not packages.install %}

hana-storage-packages:
  test.show_notification:
    - text: "hana:storage:packages:install is false: the host's build provides the packages"
{%- elif not packages.supported_family %}

hana-storage-packages:
  test.fail_without_changes:
    - name: "os_family {{ grains.get('os_family') }} is not supported: SAP HANA runs on SLES and RHEL for SAP"
{%- else %}

hana-storage-packages:
  pkg.installed:
    - pkgs: {{ packages.wanted | json }}
    - reload_modules: true

hana-storage-python-libraries:
{%-   if packages.system_python %}
  pkg.installed:
    - pkgs: {{ packages.python_system | json }}
{%-   else %}
  pip.installed:  # no bin_env: into the Python running Salt (salt-pip in the onedir)
    - pkgs: {{ packages.python | json }}
{%-   endif %}
    - reload_modules: true
{%- endif %}
