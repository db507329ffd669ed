//! Thread scheduling on a shared core: the lanes' threads wake onto it at once; the
//! threads that serve requests or copy the store's WAL give way to them.
//!
//! Linux's scheduler (EEVDF, from 6.6) lets a running thread finish its time slice
//! (1.4 ms by default on two cores) before a thread that wakes takes the core, and looks
//! again at its next tick (4 ms at `HZ=250`): a lane's worker that woke for its slot
//! while `paceline serve` wrote jobs could call 2 to 5 ms late. A thread with a shorter
//! slice than the running one takes the core when it wakes (`PREEMPT_SHORT`, Linux
//! 6.12), so the lanes' threads ask for the shortest; the others ask for the default
//! slice and a lower priority (nice 10). Neither needs a privilege. Older kernels keep
//! the default slice, other systems change nothing: the lanes run as before.

/// The slice the lanes' threads ask for: the shortest Linux grants (0.1 ms).
const LANE_SLICE_NANOS: u64 = 100_000;

/// The nice value of the threads that give way (the lanes' stay at 0): on a busy core the
/// scheduler runs a lane whose slot has come before a request or a checkpoint.
const SERVER_NICE: i32 = 10;

/// `struct sched_attr` of `sched_setattr(2)` (its first version, 56 bytes).
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
    util_min: u32,
    util_max: u32,
}

/// Gives the calling thread, under the normal policy, `nice` and a time slice of
/// `slice_nanos` (0: the system's default). Threads it starts later inherit both.
#[cfg(target_os = "linux")]
#[expect(unsafe_code, reason = "sched_setattr(2) has no wrapper in libc: the one way to ask for a time slice")]
fn set_slice_and_nice(slice_nanos: u64, nice: i32) -> bool {
    let attributes = SchedAttr { size: std::mem::size_of::<SchedAttr>() as u32, nice, runtime: slice_nanos, ..SchedAttr::default() };
    // SAFETY: the kernel reads `size` bytes of `attributes`, a live, initialised
    // `repr(C)` struct of that size; pid 0 is the calling thread.
    unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &raw const attributes, 0) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn set_slice_and_nice(_slice_nanos: u64, _nice: i32) -> bool {
    false
}

/// Asks for the shortest time slice for the calling thread and the threads it starts
/// (call it before the runtime that runs the lanes is built). Where the kernel does
/// not take it, nothing changes.
pub fn wake_lanes_promptly() {
    set_slice_and_nice(LANE_SLICE_NANOS, 0);
}

/// Gives the calling thread (a server's, or the WAL's checkpoints') the default time
/// slice and a lower priority, so the lanes' threads take the core from it when they
/// wake. Where only the nice value can be set, it is (`setpriority(2)`); where neither,
/// the thread works as before.
#[expect(unsafe_code, reason = "setpriority(2) is C's: the one way to lower a thread's priority without sched_setattr")]
pub fn yield_to_the_lanes() {
    if !set_slice_and_nice(0, SERVER_NICE) {
        // SAFETY: setpriority takes plain integers and touches no memory of ours; `who`
        // 0 is the calling thread.
        let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, SERVER_NICE) };
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The calling thread's slice and nice value, as `sched_getattr(2)` reports them.
    #[expect(unsafe_code, reason = "sched_getattr(2) has no wrapper in libc")]
    fn slice_and_nice() -> (u64, i32) {
        let mut attributes = SchedAttr::default();
        let size = std::mem::size_of::<SchedAttr>() as u32;
        // SAFETY: the kernel writes at most `size` bytes into `attributes`, a live
        // `repr(C)` struct of that size; pid 0 is the calling thread.
        let read = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &raw mut attributes, size, 0) };
        assert_eq!(read, 0, "sched_getattr failed");
        (attributes.runtime, attributes.nice)
    }

    /// Linux 6.12 and later keep a thread's own slice (`PREEMPT_SHORT` came with it).
    fn kernel_keeps_custom_slices() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut numbers = release.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse::<u32>().ok());
        (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (6, 12)
    }

    #[test]
    fn a_lanes_thread_asks_for_the_shortest_slice_and_the_threads_it_starts_inherit_it() {
        let (own, started) = std::thread::spawn(|| {
            wake_lanes_promptly();
            (slice_and_nice(), std::thread::spawn(slice_and_nice).join().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(own.1, 0, "the lanes keep their priority");
        if kernel_keeps_custom_slices() {
            assert_eq!(own.0, LANE_SLICE_NANOS);
            assert_eq!(started, own, "a thread started by a lanes' thread (a runtime's) inherits its slice");
        }
    }

    #[test]
    fn a_thread_that_gives_way_takes_the_default_slice_and_nice_ten_even_started_by_a_lanes_thread() {
        let (default_slice, _) = std::thread::spawn(slice_and_nice).join().unwrap();
        let given_way = std::thread::spawn(|| {
            wake_lanes_promptly();
            std::thread::spawn(|| {
                yield_to_the_lanes();
                slice_and_nice()
            })
            .join()
            .unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(given_way, (default_slice, SERVER_NICE));
    }
}
