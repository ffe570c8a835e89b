--[[
  mark_started: record that the bodies of these leases started running.

  A lease is acquired when the worker receives the message, long before a
  prefetched task may run, so acquire records started = 0. Only a lease marked
  started here counts a recovery when its owner dies (claim_expired, acquire's
  take-over): tasks a dead worker had prefetched but never ran are not charged
  for its death. The worker's heartbeat thread sends here, a few at a time,
  the marks that did not ride along with an acquire (acquire_many.lua), shortly
  after the pool started the tasks. A lease with a progress timeout gets its
  progress deadline here (now + progress timeout, unless a progress call set
  one already): the timeout bounds a running body, not the wait before it.
  A lease marked alone (ARGV[2]) runs with nothing beside it in its process, so
  on a shared-process pool its owner's death is its own (charge_death): the
  worker sends that mark, for a task whose earlier blame was uncertain, before
  the body starts.

  Input:
    KEYS[1] stats hash (counts the marks, field started)
    KEYS[2..n] record hash of each lease, in the order of the tokens below
    ARGV[1] owner (worker instance id)
    ARGV[2] '1' when the worker runs these tasks alone (nothing beside them in their process), else '0'
    ARGV[k+1] token of the lease whose record is KEYS[k]

  Output: number of leases marked (OK for each; leases the caller no longer
  holds are left alone)
]]
return mark_starts(KEYS[1], KEYS, 2, ARGV[1], ARGV, 3, ARGV[2])
