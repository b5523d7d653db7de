/// The read-ahead parts waiting for a slot, and which of them starts next (docs/architecture.md,
/// "Adaptive transfers": Sharing). A value with no lock or clock of its own, so tests drive it;
/// `TransferController` keeps one under its lock.
///
/// Each reader (an open file) has a queue of its own, in the order its parts asked. A free slot
/// goes to the reader with the fewest parts running, to its oldest part; between readers that
/// run as many, to the part that asked first. So readers that want more than their share get
/// equal shares, and one that wants less gets all it asks. One queue for all, in the order the
/// parts asked, served the reader whose window opened first before everyone else: 4 readers of
/// disjoint slices through `wan` finished 2–3.4× apart, and the last one ran alone at the end
/// with a window too narrow to fill the link.
struct PartQueue<Reader: Hashable, Job> {
    private struct Waiting {
        let ticket: Int
        let job: Job
    }

    private struct Queue {
        var running = 0
        var waiting: [Waiting] = []
    }

    private var queues: [Reader: Queue] = [:]
    private var nextTicket = 0
    /// Parts started and not yet finished, all readers.
    private(set) var running = 0
    /// Parts waiting for a slot, all readers.
    private(set) var waiting = 0

    /// Readers with parts waiting or running: those who share the slots now.
    var readers: Int { queues.count }

    /// Whether `reader` has parts waiting or running.
    func isSharing(_ reader: Reader) -> Bool { queues[reader] != nil }

    mutating func add(_ job: Job, for reader: Reader) {
        queues[reader, default: Queue()].waiting.append(Waiting(ticket: nextTicket, job: job))
        nextTicket += 1
        waiting += 1
    }

    /// The part to start now, if any waits; it counts as running from here until `finished`.
    mutating func next() -> (job: Job, reader: Reader)? {
        var chosen: (reader: Reader, running: Int, ticket: Int)? = nil
        for (reader, q) in queues {
            guard let first = q.waiting.first else { continue }
            if let c = chosen, (c.running, c.ticket) <= (q.running, first.ticket) { continue }
            chosen = (reader, q.running, first.ticket)
        }
        guard let reader = chosen?.reader, var q = queues[reader] else { return nil }
        let job = q.waiting.removeFirst().job
        q.running += 1
        queues[reader] = q
        running += 1
        waiting -= 1
        return (job, reader)
    }

    /// A part of `reader`'s that `next` started has ended.
    mutating func finished(for reader: Reader) {
        guard var q = queues[reader], q.running > 0 else { return }
        q.running -= 1
        running -= 1
        queues[reader] = q.running == 0 && q.waiting.isEmpty ? nil : q
    }
}
