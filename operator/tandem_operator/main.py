"""`tandem-operator`: `kopf run` with the HybridModel handlers loaded.

Every option of `kopf run` works unchanged (`--standalone`, `--namespace`, `--all-namespaces`,
`--liveness`, `--verbose`, ...). Outside a cluster it uses $KUBECONFIG, inside its ServiceAccount.
"""

from __future__ import annotations

import sys

import kopf.cli


def main(argv: list[str] | None = None) -> int:
    """Run the operator until interrupted; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        print()
    try:
        kopf.cli.main(args=["run", "--module=tandem_operator", *args], prog_name="tandem-operator",
                      standalone_mode=False)
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # click reports bad options as exceptions when not standalone
        print(f"tandem-operator: {e}", file=sys.stderr)
        return 2
    return 0
