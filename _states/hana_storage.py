"""States Salt core lacks for encrypted HANA storage.

``pillar_valid`` gates everything: an invalid pillar fails here, in test mode too, and no other
state of the formula is rendered, so no device is touched.
"""

__virtualname__ = "hana_storage"


def __virtual__():
    if "hana_storage.settings" in __salt__:
        return __virtualname__
    return False, "hana_storage state: the hana_storage execution module is not loaded (saltutil.sync_all)"


def pillar_valid(name):
    """
    Fail, naming every error and its key path, unless the ``hana:storage`` pillar is valid.

    .. code-block:: yaml

        hana-storage-pillar-valid:
          hana_storage.pillar_valid: []
    """
    ret = {"name": name, "changes": {}, "result": True, "comment": ""}
    errors = __salt__["hana_storage.validate_pillar"]()
    ret["comment"] = __utils__["hana_storage_pillar.validation_summary"](errors)
    if errors:
        ret["result"] = False
        ret["comment"] += "\nnothing was touched"
    return ret
