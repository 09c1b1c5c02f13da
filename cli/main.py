"""`kdtr` entry point. Each command lives in its own module under cli/ and is registered below;
commands parse arguments, call one typed library function and print."""
import click

from cli.bench_cmd import bench_cmd
from cli.distill_cmd import distill_cmd
from cli.format_cmds import convert_cmd, export_cmd, inspect_cmd
from cli.gen_cmd import gen_cmd
from cli.import_cmd import import_cmd
from cli.kernels_cmd import kernels_cmd
from cli.verify_cmd import verify_cmd
from conformance.exit_codes import ExitCode
from conformance.version import kdtr_version


class _Kdtr(click.Group):
    """Ctrl-C (SIGINT) ends any command with exit code 130, as shells report it, and one line: click's
    own "Aborted!" exits 1, the code of a numeric failure. Temp files are removed and outputs left as
    they were on the way out (kdtr_format.paths.write_atomically)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            name = ctx.invoked_subcommand or ""
            click.echo(f"\nkdtr {name}: interrupted; outputs not written are left as they were (exit code "
                       f"{int(ExitCode.INTERRUPTED)})", err=True)
            raise click.exceptions.Exit(int(ExitCode.INTERRUPTED)) from None


@click.group(cls=_Kdtr, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(kdtr_version(), "--version", prog_name="kdtr")
def main() -> None:
    """kdtr: golden-bundle conformance for Kimi K2.6-class inference engines.

    Exit codes: 0 pass, 1 numeric tolerance failure, 2 usage error, 3 token-stream
    mismatch, 4 DDTree mismatch, 5 invalid or corrupt file, 6 engine error, 7 coverage
    below `kdtr verify --require-coverage`, 130 interrupted (Ctrl-C).
    """


# The commands, in alphabetical order, as `kdtr --help` lists them (click sorts a group's commands by name).
main.add_command(bench_cmd)
main.add_command(convert_cmd)
main.add_command(distill_cmd)
main.add_command(export_cmd)
main.add_command(gen_cmd)
main.add_command(import_cmd)
main.add_command(inspect_cmd)
main.add_command(kernels_cmd)
main.add_command(verify_cmd)

if __name__ == "__main__":          # python -m cli.main, as the installed `kdtr`
    main()
