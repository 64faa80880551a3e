# -*- coding: utf-8 -*-
# vim: ft=sls
# Safe remediation on one minion: flags, crypttab, fstab, key file mode (hana_storage.remediate
# re-audits on the minion and never formats). Run by the triage runner, or by hand:
#   salt-run state.orchestrate hana.storage.orch.remediate \
#     pillar='{"hana_storage_remediation": {"minion": "db1", "rules": ["HANA-PERF-002"]}}'
---
{%- set request = pillar.get('hana_storage_remediation', {}) %}
{%- if request.get('minion') %}

hana-storage-remediate:
  salt.function:
    - name: hana_storage.remediate
    - tgt:
      - {{ request.minion | json }}
    - tgt_type: list
    - timeout: 600  # the minion re-audits, then fixes through state.single (queued behind a running state)
    - kwarg:
        rules: {{ request.get('rules', []) | json }}
{%- else %}

hana-storage-remediate:
  test.fail_without_changes:
    - name: "pillar hana_storage_remediation:minion is required"
{%- endif %}
