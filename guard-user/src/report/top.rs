//! `connguard top`: a live terminal view (ratatui), refreshed every second: ports held
//! per destination, listeners and their accept queues, listener guards' busiest
//! callers, the daemon's scopes, and the diagnosis. Works over ssh in any terminal; ratatui redraws only what changed, so it
//! does not flicker.
use std::time::{Duration, Instant};

use connguard_api::{listeners::Listener, ports::PortsReport, stats::Snapshot};
use ratatui::{
    Frame,
    crossterm::event::{self, Event, KeyCode, KeyModifiers},
    layout::{Constraint, Layout},
    style::{Modifier, Style},
    text::Line,
    widgets::{Block, Paragraph, Row, Table, Wrap},
};

use crate::{diagnose::ports::near_exhaustion, report::table::member_summary};

const REFRESH: Duration = Duration::from_secs(1);
const BAR_WIDTH: usize = 20;

/// What one refresh shows.
pub struct View {
    pub ports: Result<PortsReport, String>,
    pub listeners: Vec<Listener>,
    /// None without a daemon.
    pub stats: Option<Snapshot>,
}

fn time_of_day() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Shows what `gather` returns, gathered again every second, until q or Ctrl-C.
pub fn run(netns: &str, mut gather: impl FnMut() -> View) -> anyhow::Result<()> {
    let mut terminal = ratatui::init();
    let result = (|| -> anyhow::Result<()> {
        let mut view = (gather(), time_of_day());
        let mut next = Instant::now() + REFRESH;
        loop {
            terminal.draw(|f| draw(f, netns, &view.0, &view.1))?;
            let wait = next.saturating_duration_since(Instant::now());
            if event::poll(wait)? {
                if let Event::Key(k) = event::read()? {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if k.code == KeyCode::Char('q') || ctrl_c {
                        return Ok(());
                    }
                }
                continue;
            }
            view = (gather(), time_of_day());
            next = Instant::now() + REFRESH;
        }
    })();
    ratatui::restore();
    result
}

fn bar(ratio: f64) -> String {
    let full = ((ratio.clamp(0.0, 1.0)) * BAR_WIDTH as f64).round() as usize;
    format!("{}{}", "█".repeat(full), "·".repeat(BAR_WIDTH - full))
}

/// `at`: when the view was gathered.
fn draw(f: &mut Frame, netns: &str, v: &View, at: &str) {
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let [header, dests, lists, scopes, warnings] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Percentage(35),
        Constraint::Percentage(20),
        Constraint::Percentage(20),
        Constraint::Min(3),
    ])
    .areas(f.area());

    let listener_rows: Vec<Row> = v
        .listeners
        .iter()
        .map(|l| {
            Row::new(vec![
                l.addr.clone(),
                bar(l.accept_queue as f64 / l.backlog.max(1) as f64),
                format!("{}/{}", l.accept_queue, l.backlog),
                l.syn_recv.to_string(),
                l.rst_shed.map_or("-".into(), |n| n.to_string()),
                l.state.clone(),
                l.process.clone().unwrap_or_else(|| "-".into()),
            ])
        })
        .collect();
    let listener_table = Table::new(
        listener_rows,
        [
            Constraint::Length(24),
            Constraint::Length(BAR_WIDTH as u16),
            Constraint::Length(12),
            Constraint::Length(9),
            Constraint::Length(8),
            Constraint::Length(6),
            Constraint::Min(10),
        ],
    )
    .header(
        Row::new([
            "LISTENER",
            "ACCEPT QUEUE",
            "QUEUE",
            "SYN_RECV",
            "RST",
            "STATE",
            "PROCESS",
        ])
        .style(bold),
    )
    .block(Block::bordered().title(" listeners "));
    // The callers' panel takes room from the listeners only where a guard has
    // per-caller budgets.
    match caller_table(v, bold) {
        Some(callers_table) => {
            let [lists, callers] =
                Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)])
                    .areas(lists);
            f.render_widget(listener_table, lists);
            f.render_widget(callers_table, callers);
        }
        None => f.render_widget(listener_table, lists),
    }

    let head = match &v.ports {
        Ok(r) => format!(
            "connguard top — netns {netns} — ephemeral range {}-{} ({} ports), tcp_tw_reuse {} — {} — q quits",
            r.ephemeral_range[0], r.ephemeral_range[1], r.ephemeral_ports, r.tcp_tw_reuse, at
        ),
        Err(e) => format!("connguard top — netns {netns} — {e}"),
    };
    f.render_widget(Paragraph::new(head).style(bold), header);

    // Source pools near exhaustion come first: bind() before connect() spends them with
    // every destination's own count far from full.
    let rows: Vec<Row> = v
        .ports
        .as_ref()
        .map(|r| {
            let pools = r
                .bound_sources
                .iter()
                .filter(|p| near_exhaustion(p))
                .map(|p| {
                    Row::new(vec![
                        p.src.clone(),
                        "any (bind() pool)".into(),
                        bar(p.ratio),
                        format!("{}/{}", p.in_use, r.ephemeral_ports),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                        String::new(),
                    ])
                });
            let destinations = r.destinations.iter().map(|d| {
                Row::new(vec![
                    d.src.clone(),
                    d.dst.clone(),
                    bar(d.ratio),
                    format!("{}/{}", d.in_use, r.ephemeral_ports),
                    d.time_wait.to_string(),
                    d.active.to_string(),
                    d.time_wait_per_s.map_or("-".into(), |x| format!("{x:.1}")),
                    d.scopes.join(","),
                ])
            });
            pools.chain(destinations).collect()
        })
        .unwrap_or_default();
    let widths = [
        Constraint::Length(16),
        Constraint::Length(24),
        Constraint::Length(BAR_WIDTH as u16),
        Constraint::Length(12),
        Constraint::Length(9),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Min(8),
    ];
    let table = Table::new(rows, widths)
        .header(
            Row::new([
                "SOURCE",
                "DESTINATION",
                "PORTS HELD",
                "IN_USE",
                "TIME_WAIT",
                "ACTIVE",
                "TW/S",
                "SCOPES",
            ])
            .style(bold),
        )
        .block(
            Block::bordered()
                .title(" source pools near exhaustion, then destinations by ports held "),
        );
    f.render_widget(table, dests);

    let scope_rows: Vec<Row> = v
        .stats
        .as_ref()
        .map(|s| {
            s.scopes
                .iter()
                .map(|s| {
                    let c = &s.counts;
                    Row::new(vec![
                        s.name.clone(),
                        s.mode.clone(),
                        c.active.to_string(),
                        c.peak.to_string(),
                        c.admitted.to_string(),
                        c.shed.to_string(),
                        c.would_shed.to_string(),
                        member_summary(s, 2),
                    ])
                })
                .collect()
        })
        .unwrap_or_default();
    let title = if v.stats.is_some() {
        " scopes "
    } else {
        " scopes (no daemon answers) "
    };
    let scope_table = Table::new(
        scope_rows,
        [
            Constraint::Min(12),
            Constraint::Length(8),
            Constraint::Length(8),
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Min(20),
        ],
    )
    .header(
        Row::new([
            "SCOPE",
            "MODE",
            "ACTIVE",
            "PEAK",
            "ADMITTED",
            "SHED",
            "WOULD_SHED",
            "MEMBERS",
        ])
        .style(bold),
    )
    .block(Block::bordered().title(title));
    f.render_widget(scope_table, scopes);

    let mut lines: Vec<Line> = match &v.ports {
        Ok(r) if r.warnings.is_empty() => vec![Line::from(
            "no destination or source address near exhaustion",
        )],
        Ok(r) => r.warnings.iter().map(|w| Line::from(w.as_str())).collect(),
        Err(e) => vec![Line::from(e.as_str())],
    };
    for r in v.stats.iter().flat_map(|s| &s.runtimes) {
        if !r.connected {
            lines.push(Line::from(format!(
                "runtime {} at {} unreachable: {}",
                r.source,
                r.endpoint,
                r.last_error.as_deref().unwrap_or("connecting")
            )));
        }
    }
    if let Some(f) = v.stats.as_ref().and_then(|s| s.fleet.as_ref()) {
        let sync = f.last_sync_ms.map_or("never".to_string(), |ms| {
            format!("{:.1} s ago", ms as f64 / 1000.0)
        });
        for b in &f.budgets {
            lines.push(Line::from(format!(
                "fleet budget {}: share {}{} of {}  active {}  wants {}  hosts {}  synced {sync}  store errors {}",
                b.name,
                b.share.map_or("-".to_string(), |s| s.to_string()),
                if b.safe { " (safe)" } else { "" },
                b.total,
                b.active,
                b.wants,
                b.hosts,
                f.store_errors
            )));
        }
    }
    if let Some(t) = v.stats.as_ref().map(|s| &s.destination_table)
        && t.full()
    {
        lines.push(Line::from(super::table::destination_table(t)));
    }
    for s in v.stats.iter().flat_map(|s| &s.scopes) {
        for w in &s.warnings {
            lines.push(Line::from(format!("scope {}: {w}", s.name)));
        }
        for b in &s.open_breakers {
            lines.push(Line::from(format!(
                "breaker {} ({}% let through): scope {} rule {} dst {}",
                b.state,
                b.percent,
                s.name,
                b.rule.as_deref().unwrap_or("-"),
                b.dst
            )));
        }
    }
    f.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: true })
            .block(Block::bordered().title(" diagnosis ")),
        warnings,
    );
}

/// Listener guards' busiest callers (by active connections, then refusals), from the
/// daemon's stats; none where no guard has per-caller budgets.
fn caller_table(v: &View, bold: Style) -> Option<Table<'static>> {
    let guards: Vec<_> = v
        .stats
        .iter()
        .flat_map(|s| &s.listeners)
        .filter_map(|l| Some((l, l.per_source.as_ref()?)))
        .collect();
    if guards.is_empty() {
        return None;
    }
    let rows: Vec<Row> = guards
        .into_iter()
        .flat_map(|(l, p)| {
            p.top.iter().map(|c| {
                Row::new(vec![
                    l.name.clone(),
                    c.caller.clone(),
                    c.active.to_string(),
                    (c.refused + c.would_refuse).to_string(),
                    if c.refusing { "yes" } else { "-" }.to_string(),
                ])
            })
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Length(12),
            Constraint::Min(18),
            Constraint::Length(7),
            Constraint::Length(8),
            Constraint::Length(8),
        ],
    )
    .header(Row::new(["GUARD", "CALLER", "ACTIVE", "REFUSED", "REFUSING"]).style(bold))
    .block(Block::bordered().title(" callers of listener guards "));
    Some(table)
}
