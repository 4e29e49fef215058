//! Reconcile slots per namespace. A step runs the model and `runSync`
//! tools inside its reconcile, so a slow model, a slow tool or a slow MCP
//! server holds a slot for as long as its timeout. The operator serves
//! every namespace from one pool of slots: without a cap, one namespace's
//! sessions could hold all of them and stall everyone else's. A namespace
//! at its cap has its further sessions looked at again shortly instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Sessions of one namespace that may be reconciled at once.
pub struct NamespaceSlots {
    limit: usize,
    busy: Mutex<HashMap<String, usize>>,
}

/// A slot held by one reconcile; given back when dropped.
pub struct Slot {
    slots: Arc<NamespaceSlots>,
    namespace: String,
}

impl NamespaceSlots {
    /// At most `limit` (at least one) reconciles per namespace at once.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(NamespaceSlots {
            limit: limit.max(1),
            busy: Mutex::default(),
        })
    }

    /// A slot in `namespace`, or `None` while it holds all of its own.
    pub fn take(self: &Arc<Self>, namespace: &str) -> Option<Slot> {
        let mut busy = self.busy.lock().expect("namespace slots");
        let held = busy.entry(namespace.to_string()).or_insert(0);
        if *held >= self.limit {
            return None;
        }
        *held += 1;
        Some(Slot {
            slots: self.clone(),
            namespace: namespace.to_string(),
        })
    }

    /// Slots held in `namespace` now.
    #[cfg(test)]
    fn held(&self, namespace: &str) -> usize {
        let busy = self.busy.lock().expect("namespace slots");
        busy.get(namespace).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut busy = self.slots.busy.lock().expect("namespace slots");
        if let Some(held) = busy.get_mut(&self.namespace) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                // Only namespaces with work under way are remembered.
                busy.remove(&self.namespace);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_holds_at_most_its_slots_and_others_are_not_affected() {
        let slots = NamespaceSlots::new(2);
        let a1 = slots.take("a").expect("first");
        let _a2 = slots.take("a").expect("second");
        assert!(slots.take("a").is_none(), "a is at its cap");
        let _b = slots.take("b").expect("b has its own");
        drop(a1);
        assert_eq!(slots.held("a"), 1);
        assert!(slots.take("a").is_some(), "a slot came back");
    }

    #[test]
    fn a_namespace_with_nothing_under_way_is_forgotten() {
        let slots = NamespaceSlots::new(1);
        drop(slots.take("gone").unwrap());
        assert!(slots.busy.lock().unwrap().is_empty());
    }
}
