import Foundation
import StorageClient

/// One ranged download of consecutive blocks, shared by every reader that needs any of them
/// (single flight). Readers wait on it and copy from its buffer, so a download serves its
/// waiters even when the disk cache is off. The buffer is charged to the memory budget
/// until the last reference goes.
final class Flight: @unchecked Sendable {
    let firstBlock: Int
    let blockCount: Int
    let start: Int64
    let buffer: UnsafeMutableRawBufferPointer
    private let budget: MemoryBudget
    private let condition = NSCondition()
    private var outcome: Result<Void, StorageError>?

    init(firstBlock: Int, blockCount: Int, start: Int64, length: Int, budget: MemoryBudget) {
        self.firstBlock = firstBlock
        self.blockCount = blockCount
        self.start = start
        self.budget = budget
        buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: length, alignment: 4096)
    }

    deinit {
        buffer.deallocate()
        budget.release(Int64(buffer.count))
    }

    func contains(block: Int) -> Bool { block >= firstBlock && block < firstBlock + blockCount }

    func finish(_ result: Result<Void, StorageError>) {
        condition.lock()
        outcome = result
        condition.broadcast()
        condition.unlock()
    }

    /// Waits for the download; nil if the waiting reader was interrupted first.
    func wait(isCancelled: (@Sendable () -> Bool)?) -> Result<Void, StorageError>? {
        condition.lock()
        defer { condition.unlock() }
        while outcome == nil {
            if let isCancelled, isCancelled() { return nil }
            _ = condition.wait(until: Date().addingTimeInterval(0.05))
        }
        return outcome
    }
}
