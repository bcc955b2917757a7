//! How a record's values reach its windows in the epoch's changes: each window read once from
//! the changes or the state, the record added all or none.

use std::collections::hash_map::Entry;

use smallvec::SmallVec;

use super::{FastMap, StateReader, window_bytes};
use crate::declare::{Job, Value};
use crate::group_key::GroupKey;
use crate::types::{PartitionId, WindowKey};
use crate::window_agg::WindowAgg;

/// A window's value as this epoch's changes, then the state, hold it (empty if neither does),
/// and whether this epoch has not changed it yet.
pub(super) fn window_value<S: StateReader>(
    epoch_windows: &FastMap<WindowKey, WindowAgg>,
    store: &S,
    partition: PartitionId,
    key: &WindowKey,
    job: &Job,
) -> Result<(WindowAgg, bool), S::Error> {
    Ok(match epoch_windows.get(key) {
        Some(held) => (held.clone(), false),
        None => (
            store
                .window(partition, key)?
                .unwrap_or_else(|| job.empty_value()),
            true,
        ),
    })
}

/// The bytes a record's windows newly take in the epoch's state, or the window whose value
/// would overflow (and the column): then no window changed.
pub(super) type Added = Result<usize, (i64, crate::declare::Overflow)>;

/// Adds `inputs` to one window, held in this epoch's changes or read from the state (empty if
/// neither has it), hashing its key once.
pub(super) fn add_to_window<S: StateReader>(
    epoch_windows: &mut FastMap<WindowKey, WindowAgg>,
    store: &S,
    partition: PartitionId,
    key: WindowKey,
    job: &Job,
    inputs: &[Option<Value>],
) -> Result<Added, S::Error> {
    let start = key.window_start_ms;
    let added = match epoch_windows.entry(key) {
        Entry::Occupied(mut held) => job.add(held.get_mut(), inputs).map(|()| 0),
        Entry::Vacant(slot) => {
            let mut value = store
                .window(partition, slot.key())?
                .unwrap_or_else(|| job.empty_value());
            job.add(&mut value, inputs).map(|()| {
                let bytes = window_bytes(slot.key(), &value);
                slot.insert(value);
                bytes
            })
        }
    };
    Ok(added.map_err(|overflow| (start, overflow)))
}

/// Adds `inputs` to the windows of `group` starting at `starts` (a hopping record's open
/// ones): all or none.
pub(super) fn add_to_windows<S: StateReader>(
    epoch_windows: &mut FastMap<WindowKey, WindowAgg>,
    store: &S,
    partition: PartitionId,
    (group, starts): (GroupKey, impl Iterator<Item = i64>),
    job: &Job,
    inputs: &[Option<Value>],
) -> Result<Added, S::Error> {
    let mut added: SmallVec<[(WindowKey, WindowAgg, bool); 4]> = SmallVec::new();
    for start in starts {
        let key = WindowKey {
            window_start_ms: start,
            key: group.clone(),
        };
        let (mut value, new) = window_value(epoch_windows, store, partition, &key, job)?;
        if let Err(overflow) = job.add(&mut value, inputs) {
            return Ok(Err((start, overflow)));
        }
        added.push((key, value, new));
    }
    let mut bytes = 0;
    for (key, value, new) in added {
        if new {
            bytes += window_bytes(&key, &value);
        }
        epoch_windows.insert(key, value);
    }
    Ok(Ok(bytes))
}

/// The group key of an event's key values, as the view shows them.
pub(super) fn group_key(job: &Job, values: SmallVec<[Value; 4]>) -> GroupKey {
    let mut parts = SmallVec::with_capacity(values.len());
    for (value, &field) in values.into_iter().zip(&job.keys) {
        parts.push(value.into_key_text(job.fields[field].scale));
    }
    GroupKey::from_parts(parts)
}
