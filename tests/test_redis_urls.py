"""Redis URLs in logs and error messages: no password, however the URL is written."""

from __future__ import annotations

import pytest

from tiers.errors import ConfigError
from tiers.redis_urls import parse_redis_url, redacted_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://alice:s3cret@h:6379/0", "redis://alice:***@h:6379/0"),
    ("redis://:s3cret@h", "redis://:***@h"),
    ("rediss://s3cret@h/1", "rediss://***@h/1"),
    ("unix://u:s3cret@/tmp/s.sock?db=1", "unix://u:***@/tmp/s.sock?db=1"),
    ("redis+sentinel://u:s3cret@h1,h2/m?sentinel_password=s3cret", "redis+sentinel://u:***@h1,h2/m?sentinel_password=***"),
    ("redis+sentinel://h1/m?sentinel%5Fpassword=s3cret", "redis+sentinel://h1/m?sentinel%5Fpassword=***"),
    ("rediss://h/0?ssl_ca_certs=/ca.pem&PASSWORD=s3cret&token=s3cret;passwd=s3cret",
     "rediss://h/0?ssl_ca_certs=/ca.pem&PASSWORD=***&token=***;passwd=***"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://h/0?password=", "redis://h/0?password="),
    # Malformed: an unencoded delimiter in the password, an '@' in a query value, a fragment.
    ("redis://u:a/s3cret@h/0", "redis://u:***@h/0"),
    ("redis://u:a?s3cret@h/0", "redis://u:***@h/0"),
    ("redis://u:a#s3cret@h/0", "redis://u:***@h/0"),
    ("redis://u:a@s3cret@h/0", "redis://u:***@h/0"),
    ("redis://h/0?password=a?s3cret", "redis://h/0?password=***"),
    ("rediss://h/0?ssl_ca_certs=/a@b&sentinel_password=s3cret", "rediss://***@b&sentinel_password=***"),
    ("redis://h/0#password=s3cret", "redis://h/0#***"),
    ("u:s3cret/x@h", "u:***@h"),
])
def test_redacted_url_hides_every_secret(url: str, shown: str) -> None:
    assert redacted_url(url) == shown
    assert "s3cret" not in redacted_url(url)


@pytest.mark.parametrize("url", [
    "redis://u:s3cret@h/0?sentinel_password=s3cret",  # a sentinel option on a plain url
    "redis+sentinel://u:s3cret@h1/m?sentinel_password=s3cret&bogus=1",
    "redis+sentinel://u:s3cret@h1/m?db=1&sentinel_password=s3cret",
    "redis://u:s3cret@h/0#frag",
    "ftp://u:s3cret@h",
    # An unencoded delimiter in the password: its pieces would be quoted as a port, a db or an option.
    "redis://u:s3cret/x@h/0",
    "redis://u:a/s3cret@h",
    "redis://u:a?s3cret=1@h",
    "redis+sentinel://u:a/s3cret@h1/m",
])
def test_refused_urls_are_quoted_without_their_secrets(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_redis_url(url)
    assert "s3cret" not in str(caught.value)
