#!/bin/sh
# pip-ca COMMAND...: run COMMAND (a pip install) trusting $EXTRA_CA_CERTS besides the system's CAs.
# Behind a TLS-intercepting proxy pip needs the proxy's CA; the build passes it as a build argument
# and it is used only for this command, in a build stage that no image ships.
set -e
if [ -n "${EXTRA_CA_CERTS:-}" ]; then
  bundle=$(mktemp)
  cat /etc/ssl/certs/ca-certificates.crt > "$bundle" 2>/dev/null || true
  printf '%s\n' "$EXTRA_CA_CERTS" >> "$bundle"
  export PIP_CERT="$bundle"
fi
exec "$@"
