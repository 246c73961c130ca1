//! Pending-send tracker: keeps the objects that back zero-copy frames alive until ZeroMQ
//! has finished sending them.
//!
//! Sends complete roughly in the order they were made, so only the oldest entry is ever
//! checked: reaping pops finished entries from the front and stops at the first one still
//! in flight, which costs one check in the common case.

use std::collections::VecDeque;

/// A FIFO of in-flight sends, each entry holding what must outlive its send.
#[derive(Debug)]
pub struct Tracker<E> {
    pending: VecDeque<E>,
}

impl<E> Default for Tracker<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> Tracker<E> {
    /// An empty tracker.
    pub fn new() -> Self {
        Self {
            pending: VecDeque::new(),
        }
    }

    /// Adds the newest in-flight send.
    pub fn push(&mut self, entry: E) {
        self.pending.push_back(entry);
    }

    /// The oldest in-flight send, the only one worth checking.
    pub fn oldest(&self) -> Option<&E> {
        self.pending.front()
    }

    /// Removes the oldest entry if `is_it` says it is the one the caller checked.
    ///
    /// Checking happens outside the tracker (it may run foreign code that touches the
    /// tracker again), so the caller confirms the entry is still the oldest one.
    pub fn pop_oldest_if(&mut self, is_it: impl FnOnce(&E) -> bool) -> Option<E> {
        if self.pending.front().is_some_and(is_it) {
            self.pending.pop_front()
        } else {
            None
        }
    }

    /// Removes every entry (shutdown: the sockets are closed, nothing is in flight).
    pub fn clear(&mut self) -> Vec<E> {
        self.pending.drain(..).collect()
    }

    /// Number of sends still tracked.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the binding does: check the oldest, pop it if finished, stop at the first
    /// unfinished one.
    fn reap(t: &mut Tracker<u32>, done_below: u32) -> Vec<u32> {
        let mut released = Vec::new();
        while let Some(&oldest) = t.oldest() {
            if oldest >= done_below {
                break;
            }
            released.extend(t.pop_oldest_if(|e| *e == oldest));
        }
        released
    }

    #[test]
    fn reaps_the_finished_prefix_only() {
        let mut t = Tracker::new();
        for i in 0..5 {
            t.push(i);
        }
        assert_eq!(reap(&mut t, 3), vec![0, 1, 2]);
        assert_eq!(t.len(), 2);
        assert!(reap(&mut t, 3).is_empty());
        assert_eq!(reap(&mut t, 10), vec![3, 4]);
        assert!(t.is_empty());
    }

    #[test]
    fn an_unfinished_oldest_entry_holds_back_later_ones() {
        let mut t = Tracker::new();
        t.push(9);
        t.push(0);
        assert!(reap(&mut t, 5).is_empty());
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn pop_oldest_if_refuses_an_entry_that_changed() {
        let mut t = Tracker::new();
        t.push(1);
        t.push(2);
        assert_eq!(t.pop_oldest_if(|e| *e == 2), None);
        assert_eq!(t.pop_oldest_if(|e| *e == 1), Some(1));
        assert_eq!(t.oldest(), Some(&2));
    }

    #[test]
    fn clear_returns_everything() {
        let mut t = Tracker::new();
        t.push('a');
        t.push('b');
        assert_eq!(t.clear(), vec!['a', 'b']);
        assert!(t.is_empty());
        assert_eq!(t.oldest(), None);
    }
}
