#!/usr/bin/env bash
# Builds the e2e cluster's control plane from Go modules (docs/e2e.md, "Building the control
# plane"): etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and helm, plus
# the Gateway API Inference Extension's InferencePool CRD copied out of the module cache.
#
# Versions are pinned by tools/{k8s,etcd,helm,gateway}/go.mod. The results live in a cache dir
# keyed by a hash of those go.mod/go.sum files, etcd's main.go, this script and the Go version:
#   ${EPDSERVE_TOOLS_CACHE:-$HOME/.cache/epdserve/k8s-tools}/<key>/bin/<binary>
#   ${EPDSERVE_TOOLS_CACHE:-$HOME/.cache/epdserve/k8s-tools}/<key>/crds/gateway-inferencepool.yaml
# and the links tools/bin and tools/crds (gitignored) point at them. Only what is missing gets
# built, so a second run takes well under a second. Work goes into <key>.partial/ (each file
# renamed into place once whole) and <key>.partial/ becomes <key>/ only when everything is
# there: a killed build never leaves a half-filled <key>/, and the next run picks up where it
# stopped.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# A shell that never read a login profile (CI's, `env -i`) may lack Go's directory on PATH:
# look where Go distributions install it before giving up.
if ! command -v go >/dev/null 2>&1; then
    for dir in /usr/local/go/bin "${HOME:-/root}/go/bin" /usr/lib/go/bin; do
        if [ -x "$dir/go" ]; then
            export PATH="$dir:$PATH"
            break
        fi
    done
fi
if ! command -v go >/dev/null 2>&1; then
    echo "tools/build.sh: no 'go' on PATH (nor in /usr/local/go/bin). The e2e tests need Go >= 1.26 to build etcd," \
        "kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and helm" \
        "(docs/e2e.md)." >&2
    exit 1
fi

# -mod=mod: the go.mod files list tools that go.sum covers, but let go fill in anything missing
# rather than fail. -buildvcs=false: etcd's main package sits in this repo; the binary must not
# depend on its git state.
export GOFLAGS="-mod=mod -buildvcs=false"

k8s_bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
all_bins=(etcd "${k8s_bins[@]}" helm)
crd_name=gateway-inferencepool.yaml

key=$(
    {
        go env GOVERSION GOOS GOARCH
        for f in build.sh etcd/main.go {k8s,etcd,helm,gateway}/go.mod {k8s,etcd,helm,gateway}/go.sum; do
            echo "== $f"
            cat "$here/$f"
        done
    } | sha256sum | cut -c1-16
)
cache=${EPDSERVE_TOOLS_CACHE:-$HOME/.cache/epdserve/k8s-tools}
out=$cache/$key
partial=$out.partial

link() { # link TARGET NAME: point tools/NAME at TARGET, replacing the old link in one rename
    local tmp="$here/.$2.$$"
    ln -sfn "$1" "$tmp"
    mv -Tf "$tmp" "$here/$2"
}

complete() { # complete DIR: all binaries and the CRD are in DIR
    local b
    for b in "${all_bins[@]}"; do [ -x "$1/bin/$b" ] || return 1; done
    [ -s "$1/crds/$crd_name" ]
}

if complete "$out"; then
    link "$out/bin" bin
    link "$out/crds" crds
    echo "k8s tools: up to date in $out"
    exit 0
fi

mkdir -p "$cache"
exec 9>"$out.lock"
flock 9 # one build per key at a time; a second `make test` waits here, then finds it done
if ! complete "$out"; then
    # A <key>/ that lost a file goes back to being partial.
    if [ -d "$out" ]; then mv -T "$out" "$partial"; fi
    mkdir -p "$partial/bin" "$partial/crds"
    rm -rf "$partial/.work"
    mkdir "$partial/.work"
    echo "k8s tools: building into $partial ($(go env GOVERSION), $(nproc) cores)"

    # gobuild DIR LDFLAGS NAME PKG [NAME PKG ...]: build the named binaries that are missing,
    # in the module at tools/DIR, in one `go build` (it shares the work), then rename each
    # one into bin/.
    gobuild() {
        local dir=$1 ldflags=$2 names=() pkgs=() t0 name
        shift 2
        while [ $# -gt 0 ]; do
            if [ ! -x "$partial/bin/$1" ]; then names+=("$1"); pkgs+=("$2"); fi
            shift 2
        done
        [ ${#names[@]} -gt 0 ] || return 0
        t0=$(date +%s)
        (cd "$here/$dir" && go build -trimpath -ldflags="$ldflags" -o "$partial/.work/" "${pkgs[@]}")
        for name in "${names[@]}"; do mv -f "$partial/.work/$name" "$partial/bin/$name"; done
        echo "k8s tools: built ${names[*]} in $(($(date +%s) - t0)) s"
    }

    modinfo() { (cd "$here/$1" && go list -m -f "$3" "$2"); } # modinfo DIR MODULE TEMPLATE

    # etcd: its version is a constant in go.etcd.io/etcd/api/v3/version.
    gobuild etcd "-s -w" etcd .

    # Kubernetes: the version fields that the release build stamps (`kube-apiserver --version`,
    # /version, and so helm's kubeVersion checks); the build date is the release's.
    kver=$(modinfo k8s k8s.io/kubernetes '{{.Version}}')
    kdate=$(modinfo k8s k8s.io/kubernetes '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}')
    kmajor=${kver#v}
    kmajor=${kmajor%%.*}
    kminor=${kver#v*.}
    kminor=${kminor%%.*}
    kflags="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        kflags+=" -X $p.gitVersion=$kver -X $p.gitMajor=$kmajor -X $p.gitMinor=$kminor"
        kflags+=" -X $p.gitTreeState=clean -X $p.buildDate=$kdate"
    done
    args=()
    for b in "${k8s_bins[@]}"; do args+=("$b" "k8s.io/kubernetes/cmd/$b"); done
    gobuild k8s "$kflags" "${args[@]}"

    # helm: without these it says "v4.3" with no patch level.
    hver=$(modinfo helm helm.sh/helm/v4 '{{.Version}}')
    hflags="-s -w -X helm.sh/helm/v4/internal/version.version=$hver"
    hflags+=" -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
    gobuild helm "$hflags" helm helm.sh/helm/v4/cmd/helm

    # The InferencePool CRD (group inference.networking.k8s.io, v1), from the pinned module.
    if [ ! -s "$partial/crds/$crd_name" ]; then
        gmod=sigs.k8s.io/gateway-api-inference-extension
        (cd "$here/gateway" && go mod download "$gmod")
        src=$(modinfo gateway "$gmod" '{{.Dir}}')/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml
        if [ ! -s "$src" ]; then
            echo "tools/build.sh: no InferencePool CRD at $src" >&2
            exit 1
        fi
        cp "$src" "$partial/.work/$crd_name"
        chmod 644 "$partial/.work/$crd_name" # the module cache's files are read-only
        mv -f "$partial/.work/$crd_name" "$partial/crds/$crd_name"
        echo "k8s tools: copied $crd_name from sigs.k8s.io/gateway-api-inference-extension" \
            "$(modinfo gateway "$gmod" '{{.Version}}')"
    fi

    rm -rf "$partial/.work"
    complete "$partial" || { echo "tools/build.sh: $partial is incomplete" >&2; exit 1; }
    mv -T "$partial" "$out"
fi
link "$out/bin" bin
link "$out/crds" crds
echo "k8s tools: ready in $out (tools/bin, tools/crds)"
