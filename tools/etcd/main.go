// etcd for the e2e cluster (docs/e2e.md): the etcd server's own entry point, nothing added.
// tools/build.sh builds it into tools/bin/etcd.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
