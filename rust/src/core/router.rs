//! Data-parallel routing: which engine gets the next request.
//!
//! The front-end learns each engine's `[waiting, running]` request counts from the DP
//! coordinator, at most every 100 ms. Between two updates a burst of requests would all
//! see the same stale counts and pile onto one engine, so the router also counts this
//! client's own requests per engine in two ways: requests sent since the last update are
//! added to the reported counts (they cannot be in them yet), and requests in flight
//! (sent, not finished) are a floor, so a stale report of an idle engine never hides what
//! this client already put there. The load of an engine is
//! `max(waiting + running + clients * sent_since_update, clients * in_flight)`.
//!
//! `clients` is the number of front-ends routing over the same engines (vLLM's
//! `client_count`: its API servers). Each sees only its own requests; scaling them by the
//! number of front-ends estimates everyone's, as vLLM's own client does, so that a burst
//! arriving at every API server at once spreads instead of each piling onto the engine the
//! last report showed idle. Each front-end also starts its rotation at its own share of the
//! engines (`num_engines * client_index / clients`), so their first picks differ.
//!
//! Ties are broken first by fewer waiting requests (an engine with a queue is saturated),
//! then by a start position that rotates on every decision, so equal engines take turns
//! instead of rank 0 getting every tie.
//!
//! An engine taken out of routing (lost: its process died, the client keeps serving on the
//! others) has the largest key there is, so it is chosen only when every engine is out,
//! which the client never lets happen: it fails whole instead.
//!
//! The decision is a linear scan over one precomputed `u64` key per engine, kept up to
//! date whenever a count changes, so choosing costs a few nanoseconds per engine.

/// Per-engine load state, kept as one sortable key plus its parts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slot {
    /// Requests waiting in the engine's queue, as last reported by the coordinator.
    waiting: u32,
    /// Requests the engine is running, as last reported by the coordinator.
    running: u32,
    /// Requests this client sent to the engine that have not finished yet.
    in_flight: u32,
    /// Requests this client sent to the engine since the last coordinator update.
    sent_since_update: u32,
    /// `load << 32 | waiting`; the smallest key wins (`u64::MAX` while out).
    key: u64,
    /// Taken out of routing (a lost engine) until put back.
    out: bool,
}

impl Slot {
    /// Recomputes `key`; `clients` scales this client's own counts (see the module doc).
    #[inline]
    fn refresh(&mut self, clients: u64) {
        if self.out {
            self.key = u64::MAX;
            return;
        }
        let reported = u64::from(self.waiting)
            + u64::from(self.running)
            + clients * u64::from(self.sent_since_update);
        let load = reported
            .max(clients * u64::from(self.in_flight))
            .min(u64::from(u32::MAX));
        self.key = (load << 32) | u64::from(self.waiting);
    }
}

/// Errors a caller can trigger; the binding maps them to `ValueError`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterError {
    /// An explicit engine rank outside `0..num_engines`.
    RankOutOfRange { rank: i64, num_engines: usize },
    /// An explicit engine rank that is out of routing (a lost engine).
    RankOut { rank: i64 },
    /// A router needs at least one engine.
    NoEngines,
    /// `client_index` must be below `client_count`, which must be at least 1.
    ClientOutOfRange { index: usize, count: usize },
}

impl std::fmt::Display for RouterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouterError::RankOutOfRange { rank, num_engines } => write!(
                f,
                "data_parallel_rank {rank} is out of range: there are {num_engines} engines"
            ),
            RouterError::RankOut { rank } => write!(
                f,
                "data_parallel_rank {rank} names an engine that was lost and is not serving"
            ),
            RouterError::NoEngines => write!(f, "a router needs at least one engine"),
            RouterError::ClientOutOfRange { index, count } => write!(
                f,
                "client_index {index} is out of range: there are {count} clients"
            ),
        }
    }
}

impl std::error::Error for RouterError {}

/// Least-loaded engine choice with an in-flight floor and a rotating tie-break.
#[derive(Clone, Debug)]
pub struct Router {
    slots: Vec<Slot>,
    /// Where the next scan starts; advances by one on every decision.
    start: usize,
    /// Front-ends routing over the same engines (>= 1); scales this client's counts.
    clients: u64,
}

impl Router {
    /// A router over `num_engines` idle engines, for the only front-end routing there.
    pub fn new(num_engines: usize) -> Result<Self, RouterError> {
        Self::for_client(num_engines, 0, 1)
    }

    /// A router over `num_engines` idle engines for front-end `client_index` of
    /// `client_count` routing over them (see the module doc).
    pub fn for_client(
        num_engines: usize,
        client_index: usize,
        client_count: usize,
    ) -> Result<Self, RouterError> {
        if num_engines == 0 {
            return Err(RouterError::NoEngines);
        }
        if client_index >= client_count {
            return Err(RouterError::ClientOutOfRange {
                index: client_index,
                count: client_count,
            });
        }
        Ok(Router {
            slots: vec![Slot::default(); num_engines],
            start: num_engines * client_index / client_count,
            clients: client_count as u64,
        })
    }

    /// Takes `engine` out of routing (`out`), or puts it back: an engine out is never
    /// chosen while another is in, and an explicit rank naming it is an error. Its
    /// counts start from zero either way (its requests ended with it; a replacement
    /// starts idle).
    pub fn set_out(&mut self, engine: i64, out: bool) -> Result<(), RouterError> {
        let index = self.check_rank(engine)?;
        let clients = self.clients;
        self.slots[index] = Slot {
            out,
            ..Slot::default()
        };
        self.slots[index].refresh(clients);
        Ok(())
    }

    /// The engines out of routing, in index order.
    pub fn out_engines(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].out)
            .collect()
    }

    /// Front-ends routing over the same engines.
    #[inline]
    pub fn clients(&self) -> u64 {
        self.clients
    }

    /// Number of engines routed over.
    #[inline]
    pub fn num_engines(&self) -> usize {
        self.slots.len()
    }

    /// The least-loaded engine; notes one request sent to it.
    #[inline]
    pub fn choose(&mut self) -> usize {
        let n = self.slots.len();
        let start = self.start;
        self.start = if start + 1 >= n { 0 } else { start + 1 };
        let mut best = start;
        let mut best_key = self.slots[start].key;
        // Two plain ranges instead of a modulo per step: strictly-smaller keeps the
        // earliest engine in rotated order on a tie.
        for (i, slot) in self.slots.iter().enumerate().skip(start + 1) {
            if slot.key < best_key {
                best = i;
                best_key = slot.key;
            }
        }
        for (i, slot) in self.slots.iter().enumerate().take(start) {
            if slot.key < best_key {
                best = i;
                best_key = slot.key;
            }
        }
        self.note_sent_unchecked(best);
        best
    }

    /// Routes to `rank` when given (an explicit `data_parallel_rank` wins), else chooses;
    /// notes one request sent either way.
    #[inline]
    pub fn route(&mut self, rank: Option<i64>) -> Result<usize, RouterError> {
        match rank {
            None => Ok(self.choose()),
            Some(rank) => {
                let index = self.check_rank(rank)?;
                if self.slots[index].out {
                    return Err(RouterError::RankOut { rank });
                }
                self.note_sent_unchecked(index);
                Ok(index)
            }
        }
    }

    /// Notes `count` requests sent to `engine` without a routing decision.
    pub fn note_sent(&mut self, engine: i64, count: u32) -> Result<(), RouterError> {
        let index = self.check_rank(engine)?;
        let clients = self.clients;
        let slot = &mut self.slots[index];
        slot.in_flight = slot.in_flight.saturating_add(count);
        slot.sent_since_update = slot.sent_since_update.saturating_add(count);
        slot.refresh(clients);
        Ok(())
    }

    /// Notes `count` of this client's requests on `engine` finished. Unknown engines
    /// (removed by a resize while their requests were finishing) are ignored, and the
    /// count never goes below zero.
    pub fn note_finished(&mut self, engine: i64, count: u32) {
        let clients = self.clients;
        if let Some(slot) = usize::try_from(engine)
            .ok()
            .and_then(|i| self.slots.get_mut(i))
        {
            slot.in_flight = slot.in_flight.saturating_sub(count);
            slot.refresh(clients);
        }
    }

    /// Replaces the coordinator's counts: `counts[i] = (waiting, running)` for engine
    /// `i`. Engines beyond `counts` (just added by a scale-up the coordinator has not
    /// reported yet) read as idle; extra entries are ignored.
    pub fn update_counts<I>(&mut self, counts: I)
    where
        I: IntoIterator<Item = (u32, u32)>,
    {
        let mut iter = counts.into_iter();
        let clients = self.clients;
        for slot in &mut self.slots {
            let (waiting, running) = iter.next().unwrap_or((0, 0));
            slot.waiting = waiting;
            slot.running = running;
            slot.sent_since_update = 0;
            slot.refresh(clients);
        }
    }

    /// Grows or shrinks to `num_engines` for elastic scaling. New engines start idle;
    /// the in-flight counts of removed engines are dropped.
    pub fn resize(&mut self, num_engines: usize) -> Result<(), RouterError> {
        if num_engines == 0 {
            return Err(RouterError::NoEngines);
        }
        self.slots.resize(num_engines, Slot::default());
        if self.start >= num_engines {
            self.start = 0;
        }
        Ok(())
    }

    /// This client's in-flight request count per engine.
    pub fn in_flight(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.in_flight).collect()
    }

    /// The load the router decides on, per engine:
    /// `max(waiting + running + clients * sent_since_update, clients * in_flight)`.
    pub fn loads(&self) -> Vec<u64> {
        self.slots.iter().map(|s| s.key >> 32).collect()
    }

    /// The coordinator's last `(waiting, running)` counts per engine.
    pub fn counts(&self) -> Vec<(u32, u32)> {
        self.slots.iter().map(|s| (s.waiting, s.running)).collect()
    }

    #[inline]
    fn check_rank(&self, rank: i64) -> Result<usize, RouterError> {
        match usize::try_from(rank) {
            Ok(i) if i < self.slots.len() => Ok(i),
            _ => Err(self.rank_error(rank)),
        }
    }

    #[cold]
    #[inline(never)]
    fn rank_error(&self, rank: i64) -> RouterError {
        RouterError::RankOutOfRange {
            rank,
            num_engines: self.slots.len(),
        }
    }

    #[inline]
    fn note_sent_unchecked(&mut self, index: usize) {
        let clients = self.clients;
        let slot = &mut self.slots[index];
        slot.in_flight = slot.in_flight.saturating_add(1);
        slot.sent_since_update = slot.sent_since_update.saturating_add(1);
        slot.refresh(clients);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spread(r: &mut Router, requests: usize) -> Vec<usize> {
        let mut per = vec![0; r.num_engines()];
        for _ in 0..requests {
            per[r.choose()] += 1;
        }
        per
    }

    #[test]
    fn an_engine_out_is_never_chosen_until_put_back() {
        let mut r = Router::new(3).unwrap();
        r.note_sent(1, 5).unwrap();
        r.set_out(1, true).unwrap();
        assert_eq!(r.out_engines(), vec![1]);
        assert_eq!(r.in_flight(), vec![0, 0, 0]);
        // Reports of the lost engine (stale: it sends none) do not bring it back.
        r.update_counts([(9, 9), (0, 0), (9, 9)]);
        assert!((0..50).all(|_| r.choose() != 1));
        assert_eq!(
            r.route(Some(1)).unwrap_err(),
            RouterError::RankOut { rank: 1 }
        );
        assert!(r.route(Some(2)).is_ok());
        r.set_out(1, false).unwrap();
        assert!(r.out_engines().is_empty());
        assert_eq!(r.choose(), 1); // back, idle, and the least loaded
        assert!(r.set_out(3, true).is_err());
    }

    #[test]
    fn zero_engines_is_an_error() {
        assert_eq!(Router::new(0).unwrap_err(), RouterError::NoEngines);
        let mut r = Router::new(2).unwrap();
        assert_eq!(r.resize(0).unwrap_err(), RouterError::NoEngines);
    }

    #[test]
    fn each_client_starts_at_its_share_of_the_engines() {
        let firsts: Vec<usize> = (0..3)
            .map(|i| Router::for_client(6, i, 3).unwrap().choose())
            .collect();
        assert_eq!(firsts, vec![0, 2, 4]);
        assert_eq!(Router::new(6).unwrap().clients(), 1);
        assert_eq!(
            Router::for_client(2, 2, 2).unwrap_err(),
            RouterError::ClientOutOfRange { index: 2, count: 2 }
        );
        assert!(Router::for_client(2, 0, 0).is_err());
    }

    #[test]
    fn own_requests_count_once_per_client() {
        // Engine 0 reported 3 running; this client sent 2 to engine 1 since the report.
        let mut alone = Router::new(2).unwrap();
        let mut one_of_two = Router::for_client(2, 0, 2).unwrap();
        for r in [&mut alone, &mut one_of_two] {
            r.update_counts([(0, 3), (0, 0)]);
            r.note_sent(1, 2).unwrap();
        }
        // Alone, engine 1 holds 2 < 3; with another front-end like it, about 4 > 3.
        assert_eq!(alone.loads(), vec![3, 2]);
        assert_eq!(one_of_two.loads(), vec![3, 4]);
        assert_eq!(alone.choose(), 1);
        assert_eq!(one_of_two.choose(), 0);
        // The in-flight floor scales too once the report has caught up.
        one_of_two.update_counts([(0, 0), (0, 0)]);
        assert_eq!(one_of_two.loads(), vec![2, 4]);
    }

    #[test]
    fn burst_before_any_update_spreads_evenly() {
        for n in [1, 2, 3, 4, 16, 64] {
            let mut r = Router::new(n).unwrap();
            let per = spread(&mut r, 64 * n + 3);
            let min = *per.iter().min().unwrap();
            let max = *per.iter().max().unwrap();
            assert!(max - min <= 1, "n={n} per={per:?}");
        }
    }

    #[test]
    fn ties_rotate_instead_of_piling_on_rank_zero() {
        let mut r = Router::new(4).unwrap();
        // Requests finish as fast as they come: every engine always looks idle.
        let mut picks = Vec::new();
        for _ in 0..8 {
            let e = r.choose();
            picks.push(e);
            r.note_finished(e as i64, 1);
        }
        assert_eq!(picks, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[test]
    fn least_loaded_by_coordinator_counts() {
        let mut r = Router::new(3).unwrap();
        r.update_counts([(0, 10), (0, 2), (0, 5)]);
        assert_eq!(r.choose(), 1);
        // Sent since the update adds to the report.
        assert_eq!(r.loads(), vec![10, 3, 5]);
        assert_eq!(r.choose(), 1);
        assert_eq!(r.choose(), 1);
        assert_eq!(r.loads(), vec![10, 5, 5]);
        // Tie 5/5 after the rotating start (now at 0): engine 1 comes first in order.
        assert_eq!(r.choose(), 1);
        assert_eq!(r.in_flight(), vec![0, 4, 0]);
    }

    #[test]
    fn in_flight_is_a_floor_under_a_stale_report() {
        let mut r = Router::new(2).unwrap();
        spread(&mut r, 10);
        // A report that predates the burst: both idle. The in-flight floor keeps 5 each.
        r.update_counts([(0, 0), (0, 0)]);
        assert_eq!(r.loads(), vec![5, 5]);
        // A report that includes the burst does not double-count it.
        r.update_counts([(1, 4), (0, 5)]);
        assert_eq!(r.loads(), vec![5, 5]);
        r.note_finished(0, 5);
        r.note_finished(1, 5);
        // Finished but not yet reported: the report still counts them.
        assert_eq!(r.loads(), vec![5, 5]);
        r.update_counts([(0, 0), (0, 0)]);
        assert_eq!(r.loads(), vec![0, 0]);
    }

    #[test]
    fn waiting_breaks_ties_between_equal_loads() {
        let mut r = Router::new(2).unwrap();
        // Fresh counts before each decision, so both rotating start positions are tried.
        for _ in 0..4 {
            r.update_counts([(0, 4), (3, 1)]);
            assert_eq!(r.choose(), 0);
            r.note_finished(0, 1);
        }
    }

    #[test]
    fn explicit_rank_wins_and_is_checked() {
        let mut r = Router::new(2).unwrap();
        r.update_counts([(0, 100), (0, 0)]);
        assert_eq!(r.route(Some(0)).unwrap(), 0);
        assert_eq!(r.in_flight(), vec![1, 0]);
        assert_eq!(
            r.route(Some(2)).unwrap_err(),
            RouterError::RankOutOfRange {
                rank: 2,
                num_engines: 2
            }
        );
        assert!(r.route(Some(-1)).is_err());
        assert_eq!(r.route(None).unwrap(), 1);
        assert!(r.note_sent(5, 1).is_err());
        r.note_sent(1, 4).unwrap();
        assert_eq!(r.in_flight(), vec![1, 5]);
    }

    #[test]
    fn finished_never_underflows_and_ignores_unknown_engines() {
        let mut r = Router::new(2).unwrap();
        r.note_finished(0, 5);
        r.note_finished(7, 1);
        r.note_finished(-1, 1);
        assert_eq!(r.in_flight(), vec![0, 0]);
    }

    #[test]
    fn update_with_fewer_or_more_entries() {
        let mut r = Router::new(3).unwrap();
        r.update_counts([(1, 1)]);
        assert_eq!(r.counts(), vec![(1, 1), (0, 0), (0, 0)]);
        r.update_counts([(1, 1), (2, 2), (3, 3), (4, 4)]);
        assert_eq!(r.counts(), vec![(1, 1), (2, 2), (3, 3)]);
    }

    #[test]
    fn resize_grows_idle_and_shrinks_dropping_state() {
        let mut r = Router::new(2).unwrap();
        spread(&mut r, 10);
        r.resize(3).unwrap();
        assert_eq!(r.in_flight(), vec![5, 5, 0]);
        // The new engine is least loaded: it gets the next five.
        let per = spread(&mut r, 5);
        assert_eq!(per, vec![0, 0, 5]);
        r.resize(1).unwrap();
        assert_eq!(r.in_flight(), vec![5]);
        assert_eq!(r.choose(), 0);
        r.note_finished(2, 1);
        assert_eq!(r.in_flight(), vec![6]);
    }

    #[test]
    fn saturating_counts_do_not_wrap() {
        let mut r = Router::new(2).unwrap();
        r.update_counts([(u32::MAX, u32::MAX), (0, 0)]);
        assert_eq!(r.loads()[0], u64::from(u32::MAX));
        r.note_sent(1, u32::MAX).unwrap();
        r.note_sent(1, 1).unwrap();
        assert_eq!(r.in_flight()[1], u32::MAX);
    }

    #[test]
    fn skewed_stale_counts_still_spread_a_burst() {
        // The coordinator says engine 0 is busy; a burst fills the others up to its
        // level first, then round-robins over all.
        let mut r = Router::new(4).unwrap();
        r.update_counts([(0, 8), (0, 0), (0, 0), (0, 0)]);
        let per = spread(&mut r, 24 + 4 * 4);
        assert_eq!(per, vec![4, 12, 12, 12]);
    }
}
