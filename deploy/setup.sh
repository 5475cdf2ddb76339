#!/bin/sh
# Creates the example deployment that deploy/compose.yaml and deploy/kubernetes/ run:
# one proxy, three hospitals (hospital-a, -b, -c: the bundled ionosphere data split
# three ways, in deploy/example/<hospital>/data/) and one analyst, alice.
#
# Every file is made by the commands docs/operations.md walks through, so this is
# also a worked example of a real deployment. Needs `fedpca` on PATH (or FEDPCA=...).
#
#   deploy/setup.sh            # once
#   deploy/setup.sh --force    # start over: new CA, keys and configs (state/ is kept)
#
# PROXY_HOST is the name owners and the analyst dial (default "proxy", the compose
# service name); it goes into the proxy's certificate together with "localhost".
#
# Two choices differ from docs/operations.md's walk-through, on purpose: monitoring is
# served on every interface (the containers' probes reach it from outside, which
# loopback would refuse), and the analyst's key has 2048 bits rather than the CLI's
# 3072 (key generation and the example's queries run faster; 2048 is the protocol's
# smallest real key size).
set -eu
FEDPCA=${FEDPCA:-fedpca}
PROXY_HOST=${PROXY_HOST:-proxy}
PORT=50051
MONITORING=0.0.0.0:9464
OWNERS="hospital-a hospital-b hospital-c"
FORCE=${1:-}
case "$FORCE" in "" | --force) ;; *) echo "usage: $0 [--force]" >&2; exit 2 ;; esac
# Starting over replaces every setting (the new analyst keys included) on purpose.
REPLACE=${FORCE:+--replace-settings}
cd "$(dirname "$0")/example"

# 1. The private CA and one certificate per node (keep certs/ca/ca-key.pem offline).
$FEDPCA certs init --out certs --owner-ids hospital-a,hospital-b,hospital-c \
    --analyst-ids alice --proxy-host "$PROXY_HOST" --proxy-host localhost $FORCE

# 2. The analyst's Paillier key and query-signing key; owners pin the two values printed.
mkdir -p analyst
$FEDPCA analyst keygen --out analyst/keys --bits 2048 $FORCE > analyst/keygen.txt
SIGNER=$(sed -n '/query signer/{n;p;}' analyst/keygen.txt)
FINGERPRINT=$(tail -n 1 analyst/keygen.txt)

# 3. The proxy's folder: proxy.toml, tls/, state/.
$FEDPCA proxy init --out proxy --certs certs --owners hospital-a,hospital-b,hospital-c \
    --listen "0.0.0.0:$PORT" --monitoring-listen "$MONITORING" \
    --budget-epsilon 3 --budget-delta 1e-5 $FORCE $REPLACE

# 4. One folder per owner; its data is already in <owner>/data/.
for owner in $OWNERS; do
    $FEDPCA owner init --out "$owner" --id "$owner" --proxy "$PROXY_HOST:$PORT" \
        --certs certs --data "$owner/data/$owner.csv" --label-column 0 \
        --max-records 200 --analyst-key "$FINGERPRINT" --analyst-signer "$SIGNER" \
        --monitoring-listen "$MONITORING" $FORCE $REPLACE
done

# 5. The analyst's folder; from the Docker host the proxy is localhost:50051.
$FEDPCA analyst init --out analyst --id alice --proxy "localhost:$PORT" \
    --key-dir analyst/keys --certs certs $FORCE

# The containers run as the user who owns these files (compose reads deploy/.env).
if [ "$(id -u)" = 0 ]; then
    echo "warning: run as root, so the containers run as root too (deploy/.env);" \
        "run deploy/setup.sh as the user who should own the node folders" >&2
fi
printf 'FEDPCA_UID=%s\nFEDPCA_GID=%s\n' "$(id -u)" "$(id -g)" > ../.env
echo "example deployment ready in $(pwd); next: docker compose -f deploy/compose.yaml up"
