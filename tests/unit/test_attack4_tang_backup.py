"""clevis_bound refreshes a header backup that HANA-KEY-007 says must never be replaced.

The Tang fix (HANA-KEY-002/-004, auto rules that ``hana_storage.remediate`` runs by default,
and a state of every Tang volume's apply, ordered before ``header_backed_up``) backs the header
up once it bound: straight through ``_back_up_header``, without the HANA-KEY-007 check that
``header_backed_up`` makes.
"""

from tests.unit.test_states import (  # noqa: F401 - fixtures
    POLICY,
    configure_loader_modules,
    cryptsetup_run,
    marks,
    opts,
    pillar_data,
    real_headers,
    restores_and_opens,
    salt_functions,
    scratch,
    states,
    tabs,
)


def test_tang_bind_after_a_stray_luksformat_keeps_the_only_backup(
    real_headers,  # noqa: F811 - the fixture imported above
    make_luks,
    keyfile,
    tmp_path,
):
    """Attack: a stray ``cryptsetup luksFormat`` of a Tang volume's device with the volume's own
    key file (the file is on the host: the obvious thing to pass). The header now has another
    UUID and no Clevis token: the audit reports HANA-KEY-007 (other_device, manual: restore from
    the backup) and HANA-KEY-002 (no binding, auto). ``remediate`` (or the next apply) runs
    ``clevis_bound`` for KEY-002: it binds, then backs the header up over the old backup; the proof
    passes (the key opens the new header, every keyslot is accounted for).

    Impact: the only copy of the old volume key is overwritten: the data behind the header, still
    on the disk, can never be decrypted again. An auto fix did what HANA-KEY-007 forbids.

    Expected: clevis_bound leaves a backup whose header lost what it holds (HANA-KEY-007, a change
    this run did not make) as it is, and says so; restoring it still brings the key's access back.
    """
    image, backup = make_luks(), tmp_path / "hana_data_0.luks-header"
    assert states.header_backed_up(str(image), str(backup), str(keyfile))["result"] is True
    kept = backup.read_bytes()
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    cryptsetup_run("luksFormat", "--type", "luks2", *cheap, "--key-file", str(keyfile), str(image))
    fact = real_headers.header_backup(str(backup))
    live = real_headers.luks_header(str(image))
    assert states.core.rules.header_backup_problem(fact, live, POLICY)["rule"] == "HANA-KEY-007"

    # clevis luks bind itself is a no-op here (run_cryptsetup runs cryptsetup only)
    states.clevis_bound(str(image), str(keyfile), POLICY, header_backup=str(backup))

    assert backup.read_bytes() == kept, "the HANA-KEY-007 backup was replaced by the stray header"
    assert restores_and_opens(tmp_path, image, backup, keyfile)
