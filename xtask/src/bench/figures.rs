//! Summaries of a figure's samples: median and spread, percentiles.
/// Median, lowest and highest of a figure's samples (one a round, or one a repetition).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Summary {
    /// None for no samples.
    pub fn of(v: &[f64]) -> Option<Summary> {
        (!v.is_empty()).then(|| Summary {
            median: median(v),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            n: v.len(),
        })
    }
}

/// The middle value; the mean of the two middle values for an even count; 0 for none.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// p50, p99 and highest of a figure's samples (nearest rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub n: usize,
}

impl Percentiles {
    /// None for no samples.
    pub fn of(v: &[f64]) -> Option<Percentiles> {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let at = |q: f64| s[((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1];
        (!s.is_empty()).then(|| Percentiles {
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
            n: s.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_of_negative_and_even_samples() {
        let s = Summary::of(&[-30.0, -10.0, -20.0, -40.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (-25.0, -40.0, -10.0, 4));
        assert_eq!(Summary::of(&[]), None);
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        let p = Percentiles::of(&v).unwrap();
        assert_eq!((p.p50, p.p99, p.max, p.n), (100.0, 198.0, 200.0, 200));
    }
}
