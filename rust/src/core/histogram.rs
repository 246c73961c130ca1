//! Many observations of one Prometheus histogram folded at once.
//!
//! `prometheus_client`'s `Histogram.observe(v)` adds `v` to the sum and one to the first
//! bucket whose upper bound is at least `v`. A front-end observes every token's
//! inter-token latency that way, one Python call per token. [`fold`] computes what a run
//! of such calls leaves: the sum after adding each value in order (the same `f64`
//! additions, so the same bits as the calls would leave) and how many values each
//! bucket gained.

/// What observing `values` in order does to a histogram whose sum is `sum` and whose
/// buckets have the upper bounds `bounds` (ascending, the last normally +inf): the new
/// sum and the count each bucket gained. A value above every bound (NaN, or any value
/// when the last bound is finite) adds to the sum and to no bucket, as `observe` does.
pub fn fold(values: impl IntoIterator<Item = f64>, sum: f64, bounds: &[f64]) -> (f64, Vec<u64>) {
    let mut total = sum;
    let mut counts = vec![0u64; bounds.len()];
    for value in values {
        total += value;
        // Not partition_point: NaN compares false with every bound, and bounds from
        // Python are not checked to be sorted; the first match is what observe takes.
        if let Some(i) = bounds.iter().position(|bound| value <= *bound) {
            counts[i] += 1;
        }
    }
    (total, counts)
}

#[cfg(test)]
mod tests {
    use super::fold;

    /// One observation at a time, as `prometheus_client` does it.
    fn observe_each(values: &[f64], sum: f64, bounds: &[f64]) -> (f64, Vec<u64>) {
        let mut total = sum;
        let mut counts = vec![0u64; bounds.len()];
        for &value in values {
            total += value;
            for (i, bound) in bounds.iter().enumerate() {
                if value <= *bound {
                    counts[i] += 1;
                    break;
                }
            }
        }
        (total, counts)
    }

    #[test]
    fn counts_each_value_in_the_first_bucket_that_holds_it() {
        let bounds = [0.01, 0.025, 0.05, f64::INFINITY];
        let (sum, counts) = fold([0.01, 0.0100001, 0.05, 3.0, 0.0, -1.0], 0.5, &bounds);
        assert_eq!(counts, vec![3, 1, 1, 1]);
        assert_eq!(sum, 0.5 + 0.01 + 0.0100001 + 0.05 + 3.0 + 0.0 + -1.0);
    }

    #[test]
    fn nan_and_values_above_a_finite_last_bound_count_nowhere() {
        let (sum, counts) = fold([f64::NAN, 2.0, 0.5], 0.0, &[1.0]);
        assert_eq!(counts, vec![1]);
        assert!(sum.is_nan());
        let (sum, counts) = fold([2.0], 1.0, &[1.0]);
        assert_eq!((sum, counts), (3.0, vec![0]));
    }

    #[test]
    fn the_sum_has_the_bits_of_one_addition_after_another() {
        // A pairwise or compensated sum would differ in the last bits here.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let values: Vec<f64> = (0..4096)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 11) as f64 / (1u64 << 53) as f64 * 0.2
            })
            .collect();
        let bounds = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, f64::INFINITY];
        let start = 1234.567_f64;
        let (sum, counts) = fold(values.iter().copied(), start, &bounds);
        let (expected_sum, expected_counts) = observe_each(&values, start, &bounds);
        assert_eq!(sum.to_bits(), expected_sum.to_bits());
        assert_eq!(counts, expected_counts);
        let naive: f64 = values.iter().sum::<f64>() + start;
        assert_ne!(
            sum.to_bits(),
            naive.to_bits(),
            "the test needs order to matter"
        );
    }

    #[test]
    fn nothing_observed_changes_nothing() {
        assert_eq!(fold([], 2.5, &[1.0, f64::INFINITY]), (2.5, vec![0, 0]));
    }
}
