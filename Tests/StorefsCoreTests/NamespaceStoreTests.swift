import Foundation
import Testing
import StorefsTestSupport
@testable import StorefsCore

/// The offline namespace's log (docs/architecture.md, "Offline namespace").
@Suite struct NamespaceStoreTests {
    let dir = temporaryDirectory()

    @Test func aBurstOfOpensQueuesOneWriteForAllItsRecords() throws {
        // Every file opened is recorded; a thousand opens by 16 threads cost a wake-up of the
        // writer and a write each when every record was its own job.
        let pool = WorkerPool(threads: 1, name: "test-ns")
        let store = try NamespaceStore(cacheDirectory: dir, source: "s", writer: pool)
        _ = store.load()
        let busy = DispatchSemaphore(value: 0)
        pool.submit { busy.wait() }  // the writer's thread is held while the records come
        for i in 0..<100 { store.recordFile("f/\(i)", FileRecord(object("f/\(i)", size: Int64(i + 1)))) }
        #expect(pool.queued <= 2, "jobs queued for 100 records: \(pool.queued)")
        busy.signal()
        store.flush(timeout: 30)
        for i in 100..<110 { store.recordFile("f/\(i)", FileRecord(object("f/\(i)", size: Int64(i + 1)))) }
        store.flush(timeout: 30)
        let loaded = try NamespaceStore(cacheDirectory: dir, source: "s").load()
        #expect(Set(loaded.files.map(\.path)) == Set((0..<110).map { "f/\($0)" }))
        #expect(loaded.files.allSatisfy { $0.record.size == Int64(Int($0.path.dropFirst(2))! + 1) })
        pool.shutdown()
    }
}
