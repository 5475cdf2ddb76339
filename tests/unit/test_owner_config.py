"""owner.toml parsing: the documented format, relative paths, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpca.codec.paillier import Obfuscation
from fedpca.dp.accounting import Accountant
from fedpca.errors import ConfigError
from fedpca.owner.config import OwnerConfig, load_config
from fedpca.query import Neighbouring, QueryKind

FINGERPRINT = "sha256:" + "ab" * 32
SIGNER = "ed25519:" + "cd" * 32

GOOD = f"""
[owner]
id = "owner-1"
proxy = "127.0.0.1:50051"
state_dir = "state/owner-1"
[tls]
ca = "certs/ca.pem"
cert = "certs/owner-1.pem"
key = "certs/owner-1.key"
insecure = false
[data]
path = "data/owner-1.csv"
header = "auto"
label_column = 0
max_records = 5000
[privacy]
neighbouring = "add-remove"
accountant = "zcdp"
[policy]
accepted_analyst_keys = ["{FINGERPRINT}"]
accepted_query_signers = ["{SIGNER}"]
max_epsilon_per_query = 1.0
max_delta_per_query = 1e-6
allow_not_private = false
allow_masked_mode = false
allowed_kinds = ["pca"]
min_quorum = 2
max_tasks_per_day = 20
[budget]
epsilon = 10.0
delta = 1e-5
[crypto]
processes = 0
obfuscation = "djn"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "conf" / "owner.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_good_file_parses_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, GOOD))
    base = (tmp_path / "conf").resolve()
    assert config.owner.id == "owner-1"
    assert config.owner.proxy == "127.0.0.1:50051"
    assert config.owner.state_dir == base / "state/owner-1"
    assert config.ledger_path.parent == base / "state/owner-1"
    assert config.tls.ca == base / "certs/ca.pem"
    assert config.tls.files().private_key == base / "certs/owner-1.key"
    assert config.tls.insecure is False
    assert config.data.path == base / "data/owner-1.csv"
    assert config.data.header == "auto"
    assert config.data.label_column == 0
    assert config.data.max_records == 5000
    assert config.data.enforce_max_records is False
    assert config.privacy.neighbouring is Neighbouring.ADD_REMOVE
    assert config.privacy.accountant is Accountant.ZCDP
    assert config.policy.accepted_analyst_keys == (FINGERPRINT,)
    assert config.policy.accepted_query_signers == (SIGNER,)
    assert config.policy.max_epsilon_per_query == 1.0
    assert config.policy.max_delta_per_query == 1e-6
    assert config.policy.delta_cap(config.budget) == 1e-6
    assert config.policy.allow_not_private is False
    assert config.policy.allow_masked_mode is False
    assert config.policy.allowed_kinds == (QueryKind.PCA,)
    assert (config.policy.min_quorum, config.policy.max_tasks_per_day) == (2, 20)
    assert (config.budget.epsilon, config.budget.delta) == (10.0, 1e-5)
    assert config.crypto.processes == 0
    assert config.crypto.obfuscation is Obfuscation.DJN
    assert config.source is not None
    assert config.with_insecure().tls.insecure is True


def test_an_enforced_capacity_is_read(tmp_path: Path) -> None:
    text = GOOD.replace("max_records = 5000", "max_records = 5000\nenforce_max_records = true")
    assert load_config(_write(tmp_path, text)).data.enforce_max_records is True


def test_defaults_and_insecure_without_tls_files(tmp_path: Path) -> None:
    text = """
[owner]
id = "o2"
proxy = "[::1]:7000"
[tls]
insecure = true
[data]
path = "/abs/x.npy"
max_records = 1
[policy]
accepted_analyst_keys = []
max_epsilon_per_query = inf
allow_not_private = true
[budget]
epsilon = inf
delta = 1e-6
"""
    config = load_config(_write(tmp_path, text))
    # Safe defaults: the deployment's relation is add/remove, masked mode is off, the
    # delta cap is the budget's delta (at most 1e-5), no signer is pinned.
    assert config.privacy.neighbouring is Neighbouring.ADD_REMOVE
    assert config.policy.accepted_query_signers == ()
    assert config.policy.allow_masked_mode is False
    assert config.policy.delta_cap(config.budget) == 1e-6
    assert config.policy.min_quorum == 2  # never a release of this owner alone, unless set
    assert config.owner.state_dir == (tmp_path / "conf").resolve() / "state/o2"
    assert config.tls.insecure and config.tls.ca is None
    assert config.data.path == Path("/abs/x.npy")
    assert config.data.label_column is None
    assert config.crypto.obfuscation is Obfuscation.DJN
    with pytest.raises(ConfigError, match=r"tls\.ca"):
        config.tls.files()


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('id = "owner-1"', 'id = "bad id!"', "owner.id"),
        ('id = "owner-1"', "id = 3", "owner.id"),
        ('proxy = "127.0.0.1:50051"', 'proxy = "127.0.0.1"', "owner.proxy"),
        ('proxy = "127.0.0.1:50051"', 'proxy = "host:99999"', "owner.proxy"),
        ('state_dir = "state/owner-1"', "state_dir = 5", "owner.state_dir"),
        ('ca = "certs/ca.pem"', "", "tls.ca"),
        ("insecure = false", 'insecure = "no"', "tls.insecure"),
        ('path = "data/owner-1.csv"', "", "data.path"),
        ('header = "auto"', 'header = "yes"', "data.header"),
        ("label_column = 0", 'label_column = "label"', "data.label_column"),
        ("label_column = 0", "label_column = true", "data.label_column"),
        ("max_records = 5000", "", "data.max_records is required"),
        ("max_records = 5000", "max_records = 0", "data.max_records"),
        ("max_records = 5000", 'max_records = 5000\nout_of_bounds = "refuse"', "clipped"),
        ("max_records = 5000", "max_records = 5000\nenforce_max_records = 1", "enforce_max"),
        ('neighbouring = "add-remove"', 'neighbouring = "swap"', "privacy.neighbouring"),
        ('accountant = "zcdp"', 'accountant = "rdp"', "privacy.accountant"),
        (f'accepted_query_signers = ["{SIGNER}"]', 'accepted_query_signers = ["x"]', "signers"),
        ("max_delta_per_query = 1e-6", "max_delta_per_query = 1e-4", "exceeds budget.delta"),
        ('allowed_kinds = ["pca"]', 'allowed_kinds = ["svm"]', "policy.allowed_kinds"),
        ("min_quorum = 2", "min_quorum = 0", "policy.min_quorum"),
        ("max_tasks_per_day = 20", "max_tasks_per_day = 1.5", "policy.max_tasks_per_day"),
        (f'accepted_analyst_keys = ["{FINGERPRINT}"]', 'accepted_analyst_keys = "x"', "policy"),
        (
            f'accepted_analyst_keys = ["{FINGERPRINT}"]',
            'accepted_analyst_keys = ["sha256:xyz"]',
            r"policy.accepted_analyst_keys\[0\]",
        ),
        ("max_epsilon_per_query = 1.0", "max_epsilon_per_query = 0", "max_epsilon_per_query"),
        ("max_epsilon_per_query = 1.0", "", "policy.max_epsilon_per_query"),
        ("max_epsilon_per_query = 1.0", "max_epsilon_per_query = nan", "max_epsilon_per_query"),
        ("allow_not_private = false", "allow_not_private = 1", "policy.allow_not_private"),
        ("epsilon = 10.0", "epsilon = -1.0", "budget.epsilon"),
        ("delta = 1e-5", "delta = 1.0", "budget.delta"),
        ("delta = 1e-5", "", "budget.delta"),
        ("processes = 0", "processes = -2", "crypto.processes"),
        ('obfuscation = "djn"', 'obfuscation = "fast"', "crypto.obfuscation"),
        ("allow_not_private = false", "allow_not_private = false\nmax_epsilon = 2", "policy"),
        ("[crypto]", "[cryptography]", "cryptography"),
    ],
)
def test_each_bad_key_is_named(tmp_path: Path, old: str, new: str, key: str) -> None:
    assert old in GOOD
    with pytest.raises(ConfigError, match=key):
        load_config(_write(tmp_path, GOOD.replace(old, new, 1)))


def test_unknown_key_is_named_not_ignored(tmp_path: Path) -> None:
    text = GOOD.replace("max_epsilon_per_query = 1.0", "max_epsilon_per_querry = 1.0")
    with pytest.raises(ConfigError, match=r"policy\.max_epsilon_per_querry"):
        load_config(_write(tmp_path, text))


def test_a_tls_table_names_every_key_it_lacks_and_a_misspelt_one(tmp_path: Path) -> None:
    """A typo in [tls] is named as such, and every missing file key is named (the first
    alone was, and an analyst's [tls] named neither)."""
    typo = GOOD.replace('ca = "certs/ca.pem"', 'cA = "certs/ca.pem"')
    with pytest.raises(ConfigError, match=r"unknown keys in section \[tls\]: tls\.cA \("):
        load_config(_write(tmp_path, typo))
    text = GOOD.replace('cert = "certs/owner-1.pem"\n', "").replace(
        'key = "certs/owner-1.key"\n', ""
    )
    with pytest.raises(
        ConfigError,
        match=r"\[tls\] needs ca, cert and key unless tls\.insecure = true: "
        r"tls\.cert, tls\.key missing",
    ):
        load_config(_write(tmp_path, text))
    insecure = text.replace("insecure = false", "insecure = true")
    assert load_config(_write(tmp_path, insecure)).tls.insecure


def test_missing_section_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[budget\]"):
        load_config(_write(tmp_path, GOOD.split("[budget]")[0]))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(_write(tmp_path, "[owner\nid = 1"))


def test_from_mapping_names_section_type_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[owner\] must be a table"):
        OwnerConfig.from_mapping({"owner": 3}, tmp_path)


def test_a_misspelt_config_key_gets_the_name_it_is_closest_to(tmp_path: Path) -> None:
    text = GOOD.replace("max_epsilon_per_query = 1.0", "max_epsilon_per_querry = 1.0")
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, text))
    assert "did you mean max_epsilon_per_query for max_epsilon_per_querry?" in str(caught.value)
