# Sourced by scripts/setup.sh and scripts/test_core.sh: `venv_install VENV ARGS...` installs
# ARGS (pip install's arguments) into the virtual environment VENV.
# The installer is uv (from the registry, into VENV, by pip): it resolves as pip does (the same
# versions, checked against pip's for the dev extra and the core venv) and installs in parallel,
# with 5x less CPU than pip (14 s against 68 s for the dev extra). uv reads its own settings, not
# pip's, so this machine's pip settings (pip's configuration files and PIP_* variables: the
# local wheels, the indexes, constraints, a certificate bundle) are handed to it as flags, and
# it considers every index for every package as pip does (unsafe-best-match; uv's default takes
# a package from the first index that has it). Where the registry has no uv, pip installs
# (--no-compile: pip would byte-compile all 28,000 files, 70 CPU-s). Not quiet: the installer's
# lines (a bar on a terminal, "+ package==version") are the progress of the minute this takes.
venv_install() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/uv" ]; then
    "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-compile "uv==0.13.9" 2>/dev/null ||
      echo "install: uv is not in the registry; installing with pip (slower)" >&2
  fi
  if [ ! -x "$venv/bin/uv" ]; then
    "$venv/bin/python" -m pip --disable-pip-version-check install --no-compile "$@" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    return
  fi
  local uv_args=(--index-strategy unsafe-best-match) v
  for v in $(_pip_setting index-url); do uv_args+=(--index-url "$v"); done
  for v in $(_pip_setting extra-index-url); do uv_args+=(--extra-index-url "$v"); done
  for v in $(_pip_setting find-links); do uv_args+=(--find-links "$v"); done
  for v in $(_pip_setting constraint); do uv_args+=(--constraint "$v"); done
  v=$(_pip_setting cert)
  SSL_CERT_FILE=${SSL_CERT_FILE:-$v} "$venv/bin/uv" pip install --python "$venv/bin/python" "${uv_args[@]}" "$@"
}

# One of pip's settings (the environment's PIP_* first, then its configuration files).
_pip_setting() { python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | head -1; }
