"""``pdrun link``: measure the bandwidth and latency between two workers on this machine."""

from __future__ import annotations

import json

import click

from shared.cli import console


@click.command("link")
@click.option(
    "--size",
    default=4 << 20,
    show_default=True,
    type=click.IntRange(min=9),
    metavar="BYTES",
    help="The large message's size (use about your pipeline's cut).",
)
@click.option(
    "--repeats", default=20, show_default=True, type=click.IntRange(min=1), help="Round trips per size."
)
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option(
    "--transport",
    type=click.Choice(["auto", "gloo"]),
    default="auto",
    show_default=True,
    help="As pdrun's: auto: through shared memory where pdrun's workers on this host would use it, else the backend.",
)
def link(size: int, repeats: int, backend: str, transport: str) -> None:
    """Measure the link between two pdrun workers on this machine (JSON on stdout).

    Two processes exchange an 8-byte and a SIZE-byte message as pdrun's workers on this
    host would (shared memory on an x86 CPU, else the backend), receives posted first; half
    a round trip is the one-way time. Plan with the result:

    \b
    Examples:
      pdrun link
      pdplan graph.json --workers 2 --bandwidth $(pdrun link | jq .bandwidth_bytes_per_s) --latency $(pdrun link | jq .latency_s)
    """
    from pdrun.link import measure, shm_usable

    shm = transport == "auto" and shm_usable(backend)
    with console.status("timing round trips between two local processes"):
        result = measure(size, repeats, backend, shm)
    how = "shared memory" if shm else f"{backend} on 127.0.0.1"
    click.echo(
        json.dumps(
            {
                "backend": backend,
                "transport": "shm" if shm else backend,
                "bandwidth_bytes_per_s": result.bandwidth,
                "latency_s": result.latency_s,
                "sizes": list(result.sizes),
                "one_way_s": list(result.one_way_s),
            }
        )
    )
    console.print(
        f"[bold]pdrun link[/]: {how}: {result.bandwidth:.3g} B/s, latency {result.latency_s * 1e6:.0f} us "
        f"(one way: {', '.join(f'{s:,} B in {t * 1e3:.3f} ms' for s, t in zip(result.sizes, result.one_way_s, strict=True))})"
    )
