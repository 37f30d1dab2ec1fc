//! Figures, the printed table and the JSON report.

use serde_json::{json, Value};

/// Several runs of one figure.
#[derive(Clone, Debug, Default)]
pub struct Stat {
    pub samples: Vec<f64>,
}

impl Stat {
    pub fn of(samples: Vec<f64>) -> Self {
        Stat { samples }
    }

    pub fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        match s.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => s[n / 2],
            n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
        }
    }

    pub fn min(&self) -> f64 {
        self.samples.iter().copied().fold(f64::INFINITY, f64::min)
    }

    pub fn max(&self) -> f64 {
        self.samples
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
    }
}

/// Percentile (nearest rank) of unsorted samples.
pub fn percentile(samples: &[f64], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// How a row's ratio is judged against its target.
#[derive(Clone, Copy, Debug)]
pub enum Goal {
    AtLeast(f64),
    AtMost(f64),
}

/// One line of the table.
#[derive(Clone, Debug)]
pub struct Row {
    pub section: &'static str,
    pub name: String,
    pub stat: Stat,
    pub unit: &'static str,
    /// (ratio, what it is relative to)
    pub ratio: Option<(f64, String)>,
    /// The target, on the ratio when there is one, else on the median.
    pub goal: Option<Goal>,
    /// Measured in a `--quick` smoke run: its sizes are not the ones the target is set
    /// for, so the target is shown but not judged either way.
    pub quick: bool,
}

impl Row {
    pub fn new(
        section: &'static str,
        name: impl Into<String>,
        stat: Stat,
        unit: &'static str,
    ) -> Self {
        Row {
            section,
            name: name.into(),
            stat,
            unit,
            ratio: None,
            goal: None,
            quick: false,
        }
    }

    pub fn ratio(mut self, ratio: f64, of: impl Into<String>) -> Self {
        self.ratio = Some((ratio, of.into()));
        self
    }

    pub fn goal(mut self, goal: Goal) -> Self {
        self.goal = Some(goal);
        self
    }

    fn judged(&self) -> f64 {
        self.ratio
            .as_ref()
            .map(|r| r.0)
            .unwrap_or(self.stat.median())
    }

    /// Whether the target is met; `None` without a target or in a quick run.
    pub fn met(&self) -> Option<bool> {
        if self.quick {
            return None;
        }
        self.goal.map(|g| match g {
            Goal::AtLeast(t) => self.judged() >= t,
            Goal::AtMost(t) => self.judged() <= t,
        })
    }

    fn target_text(&self) -> String {
        match self.goal {
            None => String::new(),
            Some(g) => {
                let (op, t) = match g {
                    Goal::AtLeast(t) => ("≥", t),
                    Goal::AtMost(t) => ("≤", t),
                };
                let what = if self.ratio.is_some() { "x" } else { self.unit };
                let mark = match self.met() {
                    Some(true) => "met",
                    Some(false) => "MISSED",
                    None => "not judged (quick)",
                };
                format!("{op} {}{what} {mark}", num(t))
            }
        }
    }
}

/// A number with sensible precision for the table.
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        let s = format!("{:.0}", v);
        // thousands separators
        let (sign, digits) = s.strip_prefix('-').map(|d| ("-", d)).unwrap_or(("", &s));
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        format!("{sign}{out}")
    } else if a >= 100.0 {
        format!("{:.0}", v)
    } else if a >= 10.0 {
        format!("{:.1}", v)
    } else {
        format!("{:.2}", v)
    }
}

pub fn print_table(rows: &[Row]) {
    let w_name = rows
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(10)
        .max(10);
    println!(
        "{:<w_name$}  {:>10}  {:>21}  {:<6}  {:>22}  target",
        "measure", "median", "spread (min-max)", "unit", "ratio"
    );
    let mut section = "";
    for r in rows {
        if r.section != section {
            section = r.section;
            println!(
                "-- {section} {}",
                "-".repeat(w_name + 70 - section.len().min(w_name + 60))
            );
        }
        let spread = if r.stat.samples.len() > 1 {
            format!("{} - {}", num(r.stat.min()), num(r.stat.max()))
        } else {
            String::new()
        };
        let ratio = r
            .ratio
            .as_ref()
            .map(|(v, of)| format!("{:.2}x {of}", v))
            .unwrap_or_default();
        println!(
            "{:<w_name$}  {:>10}  {:>21}  {:<6}  {:>22}  {}",
            r.name,
            num(r.stat.median()),
            spread,
            r.unit,
            ratio,
            r.target_text()
        );
    }
}

pub fn rows_json(rows: &[Row]) -> Value {
    Value::Array(
        rows.iter()
            .map(|r| {
                json!({
                    "section": r.section,
                    "measure": r.name,
                    "unit": r.unit,
                    "median": r.stat.median(),
                    "min": r.stat.min(),
                    "max": r.stat.max(),
                    "samples": r.stat.samples,
                    "ratio": r.ratio.as_ref().map(|x| x.0),
                    "ratio_of": r.ratio.as_ref().map(|x| x.1.clone()),
                    "target": r.goal.map(|g| match g {
                        Goal::AtLeast(t) => json!({"at_least": t}),
                        Goal::AtMost(t) => json!({"at_most": t}),
                    }),
                    "met": r.met(),
                })
            })
            .collect(),
    )
}
