#!/bin/sh
# Writes TRIAGE_CONFIG (the TOML that `triage deploy --target aws` rendered; it holds
# secret references, never secrets) to a private file and runs `triage proxy`: a fleet
# member (the consumer group assigns its partitions), or the one partition in
# TRIAGE_PARTITION when that is set. exec: the proxy gets ECS's SIGTERM directly and drains.
#
# TLS: ECS injects the [tls] files from Secrets Manager as TRIAGE_TLS_CERT, TRIAGE_TLS_KEY
# and (mTLS) TRIAGE_TLS_CLIENT_CA. They are written to files in the same private folder,
# a [tls] table naming them is appended to the config (the rendered config has none), and
# the variables are dropped before the proxy starts, so its environment holds no key.
set -eu
: "${TRIAGE_CONFIG:?TRIAGE_CONFIG must hold the triage.toml text}"
umask 077
dir="$(mktemp -d)"  # a fresh 0700 folder: nothing else can read or plant a file in it
config="$dir/triage.toml"
printf '%s\n' "$TRIAGE_CONFIG" > "$config"
if [ -n "${TRIAGE_TLS_CERT:-}" ]; then
    : "${TRIAGE_TLS_KEY:?TRIAGE_TLS_KEY must hold the PEM key of TRIAGE_TLS_CERT}"
    printf '%s\n' "$TRIAGE_TLS_CERT" > "$dir/tls-cert.pem"
    printf '%s\n' "$TRIAGE_TLS_KEY" > "$dir/tls-key.pem"
    printf '\n[tls]\ncert_file = "%s"\nkey_file = "%s"\n' \
        "$dir/tls-cert.pem" "$dir/tls-key.pem" >> "$config"
    if [ -n "${TRIAGE_TLS_CLIENT_CA:-}" ]; then
        printf '%s\n' "$TRIAGE_TLS_CLIENT_CA" > "$dir/tls-client-ca.pem"
        printf 'client_ca_file = "%s"\n' "$dir/tls-client-ca.pem" >> "$config"
    fi
fi
unset TRIAGE_CONFIG TRIAGE_TLS_CERT TRIAGE_TLS_KEY TRIAGE_TLS_CLIENT_CA
if [ -n "${TRIAGE_PARTITION:-}" ]; then
    exec triage proxy --config "$config" --partition "$TRIAGE_PARTITION" "$@"
fi
exec triage proxy --config "$config" "$@"
