# Sourced by scripts/setup.sh and scripts/test_core.sh: hands this machine's pip settings to uv,
# which reads its own and not pip's. pip's configuration files and PIP_* variables name the
# local wheels (find-links), the indexes, constraints and a certificate bundle; uv gets the
# same as flags in the array uv_args, and considers every index for every package as pip does
# (unsafe-best-match; uv's default takes a package from the first index that has it).
uv_args=(--index-strategy unsafe-best-match)
_pip_cfg() { python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | head -1; }
for _v in $(_pip_cfg index-url); do uv_args+=(--index-url "$_v"); done
for _v in $(_pip_cfg extra-index-url); do uv_args+=(--extra-index-url "$_v"); done
for _v in $(_pip_cfg find-links); do uv_args+=(--find-links "$_v"); done
for _v in $(_pip_cfg constraint); do uv_args+=(--constraint "$_v"); done
_cert=$(_pip_cfg cert)
if [ -n "$_cert" ]; then export SSL_CERT_FILE=${SSL_CERT_FILE:-$_cert}; fi
unset _v _cert
