#!/bin/sh
# Writes TRIAGE_CONFIG (the TOML that `triage deploy --target aws` rendered; it holds
# secret references, never secrets) to a private file and runs `triage proxy` for
# TRIAGE_PARTITION. exec: the proxy gets ECS's SIGTERM directly and drains.
# TRIAGE_ADVERTISED_HOST (the NLB's name, set by the stack) is read by `triage proxy`.
set -eu
: "${TRIAGE_CONFIG:?TRIAGE_CONFIG must hold the triage.toml text}"
: "${TRIAGE_PARTITION:?TRIAGE_PARTITION must name the partition to own}"
umask 077
config="$(mktemp -d)/triage.toml"  # a fresh 0700 folder: nothing else can read or plant it
printf '%s\n' "$TRIAGE_CONFIG" > "$config"
exec triage proxy --config "$config" --partition "$TRIAGE_PARTITION" "$@"
