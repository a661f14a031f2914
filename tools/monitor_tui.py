"""The monitor's terminal UI (textual): members table, role panels with sparklines, event log.

Textual gives us resizing, key handling and a test pilot; the data comes from a `ClusterView`
that the observer node's threads keep current, polled twice a second.
"""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Header, RichLog, Static

from tools.monitor_view import MEMBER_COLUMNS, member_rows, role_lines

REFRESH_S = 0.5


class MonitorApp(App):
    """Live view of one cluster. Quits on `q` or Ctrl-C."""

    CSS = """
    #members { height: 1fr; min-height: 6; }
    #panels { height: auto; max-height: 50%; }
    .panel { width: 1fr; border: round $accent; padding: 0 1; height: auto; }
    #events { height: 10; border: round $secondary; }
    """
    BINDINGS = [("q", "quit", "Quit"), ("ctrl+c", "quit", "Quit")]

    def __init__(self, attached) -> None:
        super().__init__()
        self.attached = attached
        self._log_seen = 0

    def compose(self) -> ComposeResult:
        yield Header(show_clock=True)
        with Vertical():
            yield DataTable(id="members", zebra_stripes=True, cursor_type="row")
            with Horizontal(id="panels"):
                yield Static("verifiers: waiting for stats", id="verifiers", classes="panel")
                yield Static("proposers: waiting for stats", id="proposers", classes="panel")
            yield RichLog(id="events", max_lines=500, wrap=False)
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"specbus monitor — cluster {self.attached.cluster}"
        self.query_one("#members", DataTable).add_columns(*MEMBER_COLUMNS)
        self.attached.start()
        self.set_interval(REFRESH_S, self.refresh_view)
        self.refresh_view()

    def refresh_view(self) -> None:
        att = self.attached
        att.refresh()
        view = att.view
        table = self.query_one("#members", DataTable)
        table.clear()
        for row in member_rows(view):
            table.add_row(*row, key=row[1])
        verifiers, proposers = role_lines(view)
        self.query_one("#verifiers", Static).update(
            "[b]verifiers[/b]\n" + ("\n".join(verifiers) or "no verifier stats yet"))
        self.query_one("#proposers", Static).update(
            "[b]proposers[/b]\n" + ("\n".join(proposers) or "no proposer stats yet"))
        log = self.query_one("#events", RichLog)
        lines, self._log_seen = view.new_log_lines(self._log_seen)
        for line in lines:
            log.write(line)

    def on_unmount(self) -> None:
        self.attached.stop()


def run_tui(attached) -> int:
    MonitorApp(attached).run()
    return 0
