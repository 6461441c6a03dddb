"""Standard Webhooks signatures: what headwater signs verifies with the ``standardwebhooks``
library (the reference implementation receivers use), rotation signs with both secrets, and
tampered, stale or unsigned requests are refused with a reason."""

from __future__ import annotations

import base64
import os

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from headwater.webhooks.signing import SignatureError, Signer, decode_secret, verify

OLD = "whsec_" + base64.b64encode(os.urandom(32)).decode()
NEW = "whsec_" + base64.b64encode(os.urandom(32)).decode()
BODY = b'{"type": "push", "ref": "main"}'


def test_the_reference_library_verifies_what_we_sign() -> None:
    headers = Signer.from_secrets([NEW]).headers("msg_1", BODY)
    assert Webhook(NEW).verify(BODY, headers) == {"type": "push", "ref": "main"}
    with pytest.raises(WebhookVerificationError):
        Webhook(OLD).verify(BODY, headers)


def test_during_rotation_both_secrets_sign() -> None:
    headers = Signer.from_secrets([NEW, OLD]).headers("msg_2", BODY)
    assert len(headers["webhook-signature"].split()) == 2
    assert Webhook(NEW).verify(BODY, headers)
    assert Webhook(OLD).verify(BODY, headers)  # a receiver not yet told the new secret
    assert verify(headers, BODY, [OLD]) == "msg_2"


def test_we_verify_what_the_reference_library_signs() -> None:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    signature = Webhook(NEW).sign("msg_3", now, BODY.decode())
    headers = {
        "Webhook-Id": "msg_3",
        "Webhook-Timestamp": str(int(now.timestamp())),
        "Webhook-Signature": signature,
    }
    assert verify(headers, BODY, [NEW]) == "msg_3"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h, b: (h, b + b" "), "no signature matches"),
        (lambda h, b: ({**h, "webhook-id": "other"}, b), "no signature matches"),
        (lambda h, b: ({**h, "webhook-timestamp": "1000"}, b), "from now"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-signature"}, b), "missing"),
        (lambda h, b: ({**h, "webhook-timestamp": "soon"}, b), "whole number"),
    ],
)
def test_tampered_stale_or_unsigned_requests_are_refused(change, reason) -> None:
    headers, body = change(Signer.from_secrets([NEW]).headers("msg_4", BODY), BODY)
    with pytest.raises(SignatureError, match=reason):
        verify(headers, body, [NEW])


@pytest.mark.parametrize(
    "secret", ["plain", "whsec_not base64!", "whsec_" + base64.b64encode(b"short").decode()]
)
def test_bad_secrets_say_what_is_wrong(secret: str) -> None:
    with pytest.raises(SignatureError, match=r"whsec_|base64|bytes"):
        decode_secret(secret)
