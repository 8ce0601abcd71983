"""`tandem-operator`: `kopf run` with the HybridModel handlers loaded.

Every option of `kopf run` works unchanged (`--standalone`, `--namespace`, `--all-namespaces`,
`--liveness`, `--verbose`, ...). Outside a cluster it uses $KUBECONFIG, inside its ServiceAccount.
With --leader-elect, several replicas may run: one leads and runs kopf, the others wait on a
Lease as standbys (see tandem_operator.leadership).
"""

from __future__ import annotations

import sys

import kopf.cli

from . import leadership


def run_kopf(kopf_args: list[str], controls: kopf.cli.CLIControls | None = None) -> None:
    """`kopf run --module=tandem_operator KOPF_ARGS`, in this thread."""
    kopf.cli.main(args=["run", "--module=tandem_operator", *kopf_args], prog_name="tandem-operator",
                  standalone_mode=False, obj=controls)


def main(argv: list[str] | None = None) -> int:
    """Run the operator until interrupted; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] in (["-h"], ["--help"]):
            print(__doc__.strip())
            print()
            print(leadership.parser().format_help())
            run_kopf(["--help"])
            return 0
        election, kopf_args = leadership.parse_args(args)
        if election.enabled:
            return leadership.run(election, kopf_args, run_kopf)
        run_kopf(kopf_args)
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # click reports bad options as exceptions when not standalone
        print(f"tandem-operator: {e}", file=sys.stderr)
        return 2
    return 0
