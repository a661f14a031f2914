"""The monitor's terminal UI (textual): members table, role panels with sparklines, event log.

Textual gives us resizing, key handling and a test pilot; the data comes from a `ClusterView`
that the observer node's threads keep current, polled twice a second.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Header, RichLog, Static

from tools.monitor_view import LEGEND, MEMBER_COLUMNS, member_rows, role_lines

REFRESH_S = 0.5
EVENT_ROWS = 10  # the events panel grows with its lines up to this many, then scrolls


class MonitorApp(App):
    """Live view of one cluster. Quits on `q` or Ctrl-C.

    Laid out as it is read: who is there (the members table, as tall as its rows, at most a
    third of the screen), what each role is doing (one full-width panel per role, so lines
    and sparklines never wrap at 120 columns, under a legend of what `now`, `total`, `last gen`
    and `last Ns` mean: the same labels as `--once`), and what just happened (the events, as
    tall as the lines it holds, at most EVENT_ROWS: a quiet cluster's few events do not take
    half the screen)."""

    CSS = """
    #members { height: auto; max-height: 33%; }
    #legend { height: auto; color: $text-muted; padding: 0 1; }
    #panels { height: 1fr; }
    .panel { width: 1fr; border: round $accent; padding: 0 1; height: auto; }
    #events { height: 3; border: round $secondary; }
    """
    BINDINGS = [("q", "quit", "Quit"), ("ctrl+c", "quit", "Quit")]

    def __init__(self, attached) -> None:
        super().__init__()
        self.attached = attached
        self._log_seen = 0
        self._events_held = 0  # lines in the events panel

    def compose(self) -> ComposeResult:
        yield Header(show_clock=True)
        yield DataTable(id="members", zebra_stripes=True, cursor_type="row")
        yield Static("\n".join(LEGEND), id="legend")
        with VerticalScroll(id="panels"):
            yield Static("verifiers: waiting for stats", id="verifiers", classes="panel")
            yield Static("proposers: waiting for stats", id="proposers", classes="panel")
            yield Static("gateways: none", id="gateways", classes="panel")
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
        for panel, lines in zip(("verifiers", "proposers", "gateways"), role_lines(view),
                                strict=True):
            self.query_one(f"#{panel}", Static).update(
                Text(f"{panel}\n", style="bold") + Text("\n".join(lines) or f"no {panel[:-1]} "
                                                         "stats yet"))
        log = self.query_one("#events", RichLog)
        lines, self._log_seen = view.new_log_lines(self._log_seen)
        for line in lines:
            log.write(line)
        if lines:  # sized to what it holds (+2 for its border); RichLog may defer its lines
            self._events_held = min(self._events_held + len(lines), log.max_lines or 500)
            log.styles.height = min(self._events_held, EVENT_ROWS) + 2

    def on_unmount(self) -> None:
        self.attached.stop()


def run_tui(attached) -> int:
    MonitorApp(attached).run()
    return 0
