#!/usr/bin/env bash
# Install what headwater needs to run and to test, idempotently:
#   - system packages (Java 17, PostgreSQL 15 server, Redis, the PostgreSQL JDBC driver, Chromium
#     for the console's browser tests) via apt,
#     running `apt-get update` only when something is missing;
#   - the virtualenv .venv (Python 3.11 or newer);
#   - the package itself, editable with the `dev` extra, reinstalled only when pyproject.toml
#     changed since the last install (a hash stamp is kept inside .venv);
#   - the class-data sharing archive that makes the driver's JVM start fast (made once, cached
#     under ~/.cache/headwater/jvm);
#   - Apache Kafka's broker (tests, benchmarks) and Spark's Kafka connector (the pipeline with
#     bus: kafka), fetched once from Maven Central with mvn into ~/.cache/headwater/maven;
#   - Node.js and @grpc/grpc-js, the tests' second gRPC client (tests/collector/grpc_js),
#     installed with npm into ~/.cache/headwater/grpc-js once per package-lock.json;
#   - h2spec, the HTTP/2 conformance tool the tests run against the gRPC port, built with
#     `go install` into ~/.cache/headwater/go once (Go from /usr/local/go or PATH, else Debian's).
#   - SeaweedFS's weed, the S3-compatible server the tests start (headwater.testing.s3), built
#     with the same Go into ~/.cache/headwater/go once (about 6 minutes).
# When everything is already there it does no network access and takes well under a second.
#
# Run it directly (`scripts/bootstrap.sh`) or let scripts/up and scripts/test run it.
# Environment:
#   HW_SKIP_SYSTEM_PACKAGES=1   do not check or install system packages
#   HW_PYTHON=/path/to/python   the interpreter to create .venv with
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.headwater-install-stamp"

# Debian package -> a file it provides, checked when dpkg cannot be asked.
declare -A SYSTEM_PACKAGES=(
    [openjdk-17-jre-headless]=/usr/bin/java
    [postgresql-15]=/usr/lib/postgresql/15/bin/initdb
    [redis-server]=/usr/bin/redis-server
    [libpostgresql-jdbc-java]=/usr/share/java/postgresql.jar
    [maven]=/usr/bin/mvn
    [chromium]=/usr/bin/chromium
    [nodejs]=/usr/bin/node
)

say() { printf 'bootstrap: %s\n' "$*" >&2; }
die() {
    printf 'bootstrap: error: %s\n' "$*" >&2
    exit 1
}

# Run a command as root: directly if we are root, else through sudo (prompting only on a tty).
as_root() {
    if [[ $EUID -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        if [[ -t 0 ]]; then
            sudo "$@"
        else
            sudo -n "$@"
        fi
    else
        return 127
    fi
}

# Prints the packages of "$@" that are not installed.
missing_packages() {
    local pkg status
    for pkg in "$@"; do
        if command -v dpkg-query >/dev/null 2>&1; then
            status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)"
            [[ $status == ii* ]] && continue
        elif [[ -e ${SYSTEM_PACKAGES[$pkg]:-/nonexistent} ]]; then
            continue
        fi
        printf '%s\n' "$pkg"
    done
}

install_system_packages() {
    local -a missing
    mapfile -t missing < <(missing_packages "$@")
    ((${#missing[@]} == 0)) && return 0

    local hint="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
    command -v apt-get >/dev/null 2>&1 ||
        die "missing system packages (${missing[*]}) and apt-get is not available; install them by hand: $hint"
    if [[ $EUID -ne 0 ]] && ! command -v sudo >/dev/null 2>&1; then
        die "missing system packages (${missing[*]}); not root and no sudo: as root run: $hint"
    fi

    say "installing system packages: ${missing[*]} (this can take a minute)"
    local -a apt=(env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=300)
    local log
    log="$(mktemp "${TMPDIR:-/tmp}/headwater-apt.XXXXXX")"
    if ! as_root "${apt[@]}" update >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "apt-get update failed (full output in $log); as root run: $hint"
    fi
    if ! as_root "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "apt-get install failed (full output in $log); as root run: $hint"
    fi
    rm -f "$log"

    mapfile -t missing < <(missing_packages "$@")
    ((${#missing[@]} == 0)) || die "still missing after apt-get install: ${missing[*]}"
}

# Prints the path of a python >= 3.11, or nothing.
find_python() {
    local candidate path
    for candidate in "${HW_PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [[ -n $candidate ]] || continue
        path="$(command -v "$candidate" 2>/dev/null)" || continue
        if "$path" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            printf '%s\n' "$path"
            return 0
        fi
    done
    return 1
}

ensure_venv() {
    if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        return 0
    fi
    if [[ -e $VENV ]]; then
        say "$VENV is broken or older than Python 3.11; recreating it"
        rm -rf "$VENV"
    fi

    local python
    python="$(find_python)" || die "no Python 3.11 or newer found (looked for python3.13, python3.12, python3.11, python3); install one, or set HW_PYTHON"
    say "creating $VENV with $python ($("$python" --version 2>&1))"
    if ! "$python" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        # Debian's own python3 needs python3-venv for ensurepip.
        if [[ $python == /usr/bin/* ]] && command -v apt-get >/dev/null 2>&1; then
            install_system_packages python3-venv
        fi
        "$python" -m venv "$VENV" || die "could not create $VENV with $python"
    fi
}

ensure_package() {
    local want have=""
    want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
    [[ -f $STAMP ]] && have="$(<"$STAMP")"
    [[ $want == "$have" ]] && return 0

    say "installing headwater and its dev dependencies into $VENV"
    rm -f "$STAMP"
    (cd "$ROOT" && "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[dev]') ||
        die "pip install -e '.[dev]' failed (see above)"
    printf '%s\n' "$want" >"$STAMP"
}

# The driver JVM's class-data sharing archive (headwater.pipeline.jvm_archive): made once per
# JVM and Spark version (about 30 s), then a cold Spark session starts in ~2 s instead of ~6.
ensure_jvm_archive() {
    "$VENV/bin/python" -m headwater.pipeline.jvm_archive --quiet ||
        say "could not make the JVM class archive (Spark starts without it, slower)"
}

# Apache Kafka and Spark's Kafka connector, with their dependencies (headwater.jvm.maven): fetched
# once (about a minute), then this is a check of two stamp files.
ensure_jvm_artifacts() {
    "$VENV/bin/python" -m headwater.jvm.maven broker connector delta --quiet ||
        die "could not fetch Apache Kafka, Spark's Kafka connector or Delta Lake for Spark from Maven Central (see above)"
}

# @grpc/grpc-js for tests/collector/test_grpc_clients.py, outside the checkout (as the JVM
# artifacts are): installed again only when the lock file changes.
ensure_grpc_js() {
    local src="$ROOT/tests/collector/grpc_js"
    local dest="${XDG_CACHE_HOME:-$HOME/.cache}/headwater/grpc-js"
    local want
    want="$(sha256sum "$src/package-lock.json" | cut -c1-16)"
    [[ -f $dest/.stamp && $(<"$dest/.stamp") == "$want" ]] && return 0
    command -v npm >/dev/null 2>&1 || die "npm is missing (Debian: apt-get install npm)"
    say "installing @grpc/grpc-js for the gRPC client tests into $dest"
    rm -rf "$dest"
    mkdir -p "$dest"
    cp "$src/package.json" "$src/package-lock.json" "$dest/"
    (cd "$dest" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2) ||
        die "npm ci of @grpc/grpc-js failed (see above)"
    printf '%s\n' "$want" >"$dest/.stamp"
}

# h2spec for tests/collector/test_h2spec.py, outside the checkout like the other test tools.
H2SPEC_MODULE="github.com/summerwind/h2spec/cmd/h2spec@v2.2.1+incompatible"
ensure_h2spec() {
    local gopath="${XDG_CACHE_HOME:-$HOME/.cache}/headwater/go"
    [[ -x $gopath/bin/h2spec ]] && return 0
    local go
    go="$(PATH="$PATH:/usr/local/go/bin" command -v go 2>/dev/null || true)"
    if [[ -z $go && ${HW_SKIP_SYSTEM_PACKAGES:-0} != 1 ]]; then
        install_system_packages golang-go
        go="$(command -v go 2>/dev/null || true)"
    fi
    [[ -n $go ]] || die "Go is needed to build h2spec and was not found; install Go (golang-go)"
    say "building h2spec into $gopath (once; about 20 s)"
    GOPATH="$gopath" GOFLAGS=-modcacherw "$go" install "$H2SPEC_MODULE" >&2 ||
        die "go install $H2SPEC_MODULE failed (see above)"
}

# SeaweedFS's weed for the tests' S3 server (headwater.testing.s3): built once with the Go that
# ensure_h2spec found, then this is a check of one stamp file.
ensure_weed() {
    PATH="$PATH:/usr/local/go/bin" "$VENV/bin/python" -m headwater.testing.s3 --quiet ||
        die "could not build SeaweedFS's weed, the tests' S3 server (see above)"
}

main() {
    # One bootstrap at a time for this checkout (scripts/up and scripts/test may race).
    if command -v flock >/dev/null 2>&1; then
        local lock
        lock="${TMPDIR:-/tmp}/headwater-bootstrap-$(printf '%s' "$ROOT" | sha256sum | cut -c1-16).lock"
        exec 9>"$lock"
        flock 9
    fi

    if [[ ${HW_SKIP_SYSTEM_PACKAGES:-0} != 1 ]]; then
        install_system_packages "${!SYSTEM_PACKAGES[@]}"
        # Debian packages npm apart from nodejs; a Node.js from elsewhere brings its own
        command -v npm >/dev/null 2>&1 || install_system_packages npm
    fi
    ensure_venv
    ensure_package
    ensure_jvm_archive
    ensure_jvm_artifacts
    ensure_grpc_js
    ensure_h2spec
    ensure_weed
}

main "$@"
