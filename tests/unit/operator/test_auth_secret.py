"""The auth Secret with `create` and `get` only (issue 27): tokens derived from the operator key
and the deployment's uid; an existing Secret used only when it is the operator's, else refused
with a status reason."""

from __future__ import annotations

import base64

import pytest

from dsv4_operator import auth_secret as A
from dsv4_operator.manifests import AUTH_SECRET_KEYS, Owner

OWNER = Owner("flash", "serving", "uid-1")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_tokens_are_derived_from_the_operator_key_and_the_uid() -> None:
    one = A.derived_values(b"k", "uid-1")
    assert set(one) == set(AUTH_SECRET_KEYS)
    assert one == A.derived_values(b"k", "uid-1")  # two racing creators write the same values
    assert len(set(one.values())) == len(one)  # one token per key: router admin is not engine admin
    assert all(len(v) >= 43 for v in one.values())  # 256 bits
    assert set(one.values()).isdisjoint(A.derived_values(b"k", "uid-2").values())
    assert set(one.values()).isdisjoint(A.derived_values(b"other", "uid-1").values())


def test_the_operator_key_comes_from_its_file(tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text("from-the-chart\n")
    assert A.operator_key({A.OPERATOR_KEY_FILE_ENV: str(key)}) == b"from-the-chart"
    assert A.operator_key({A.OPERATOR_KEY_ENV: "env"}) == b"env"
    assert A.operator_key({}) == A.operator_key({})  # a process key: stable within the process


def secret(labels=None, refs=None, data=None, annotations=None) -> dict:
    return {
        "metadata": {"name": "s", "labels": labels or {}, "ownerReferences": refs or [], "annotations": annotations},
        "data": data if data is not None else {k: b64("v-" + k) for k in AUTH_SECRET_KEYS},
    }


def test_only_the_operators_secret_is_used() -> None:
    with pytest.raises(A.AuthSecretRefused) as err:
        A.usable_values(secret(), OWNER)
    assert err.value.reason == A.SECRET_NOT_OWNED and "not the operator's" in str(err.value)
    with pytest.raises(A.AuthSecretRefused):  # someone else's owner reference is not ours
        A.usable_values(secret(refs=[{"uid": "uid-9"}]), OWNER)
    given = {
        "labels": {"app.kubernetes.io/managed-by": "dsv4-operator"},
        "annotations": {A.ANNOTATION_SECRET_FOR: "flash"},
    }
    assert A.usable_values(secret(**given), OWNER)["admin-token"] == "v-admin-token"
    assert A.usable_values(secret(refs=[{"uid": "uid-1"}]), OWNER)["pd-secret"] == "v-pd-secret"


def test_another_deployments_secret_is_never_used() -> None:
    """Issue 39 item 1: every Secret the operator creates carries its managed-by label, so the
    label alone let deployment B name A's Secret and run with A's admin, PD and router tokens."""
    a_ref = {"apiVersion": "serving.dsv4.dev/v1alpha1", "kind": "DSV4Deployment", "name": "a", "uid": "uid-a"}
    created_for_a = secret(
        labels={"app.kubernetes.io/managed-by": "dsv4-operator"},
        refs=[a_ref],
        annotations={A.ANNOTATION_SECRET_FOR: "a"},
    )
    with pytest.raises(A.AuthSecretRefused) as err:
        A.usable_values(created_for_a, OWNER)
    assert err.value.reason == A.SECRET_OF_ANOTHER and "'a'" in str(err.value)
    assert A.usable_values(created_for_a, Owner("a", "serving", "uid-a"))["pd-secret"] == "v-pd-secret"
    # Relabelled for B but still owned by A: refused (the owner reference says whose tokens they are).
    with pytest.raises(A.AuthSecretRefused) as err:
        A.usable_values(
            {
                **created_for_a,
                "metadata": {**created_for_a["metadata"], "annotations": {A.ANNOTATION_SECRET_FOR: "flash"}},
            },
            OWNER,
        )
    assert err.value.reason == A.SECRET_OF_ANOTHER
    # The user's own Secret with the label but given to another deployment (or to none): refused.
    for given_to in (None, {A.ANNOTATION_SECRET_FOR: "a"}):
        with pytest.raises(A.AuthSecretRefused) as err:
            A.usable_values(
                secret(labels={"app.kubernetes.io/managed-by": "dsv4-operator"}, annotations=given_to), OWNER
            )
        assert err.value.reason == A.SECRET_NOT_OWNED and A.ANNOTATION_SECRET_FOR in str(err.value)


def test_the_secret_the_operator_creates_names_its_deployment() -> None:
    from dsv4_operator.manifests import auth_secret
    from dsv4_operator.spec import parse_spec

    made = auth_secret(parse_spec({"model": {"name": "m", "path": "/m"}, "engine": {"image": "i"}}), OWNER, {})
    assert made["metadata"]["annotations"] == {A.ANNOTATION_SECRET_FOR: "flash"}
    assert made["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_an_unusable_secret_of_ours_is_refused_with_its_reason() -> None:
    ours = {"app.kubernetes.io/managed-by": "dsv4-operator"}
    with pytest.raises(A.AuthSecretRefused) as err:
        A.usable_values(
            secret(
                labels=ours,
                refs=[{"uid": "uid-1"}],
                data={k: base64.b64encode(b"\xff\xfe").decode() for k in AUTH_SECRET_KEYS},
            ),
            OWNER,
        )
    assert err.value.reason == A.SECRET_UNUSABLE and "UTF-8" in str(err.value)
    with pytest.raises(A.AuthSecretRefused) as err:
        A.usable_values(secret(labels=ours, refs=[{"uid": "uid-1"}], data={"admin-token": b64("a")}), OWNER)
    assert err.value.reason == A.SECRET_UNUSABLE and "pd-secret" in str(err.value)
