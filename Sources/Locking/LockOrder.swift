import Foundation
import Synchronization

/// A lock's place in storefs's one lock order (docs/architecture.md, "Threads and locks"). A
/// thread may take a lock only while every lock it holds comes earlier in the order (a lower
/// rank): two locks are never taken in opposite orders, so no two threads can deadlock on
/// them. Locks of one level are never held together (two objects' locks of one kind, say).
///
/// Debug builds check it on every acquisition (`LockOrder`): an inversion ends the process
/// with both locks named, so the unit and integration suites (which run the debug build)
/// fail on it. Release builds check nothing.
public struct LockLevel: Sendable, Equatable, CustomStringConvertible {
    public let rank: Int
    public let name: String

    public init(_ rank: Int, _ name: String) {
        self.rank = rank
        self.name = name
    }

    public var description: String { "\(name) (\(rank))" }
}

/// The debug-build check of the lock order: each thread's held locks, as a stack of ranks.
public enum LockOrder {
    #if DEBUG
    public static let isChecking = true
    #else
    public static let isChecking = false
    #endif

    /// The locks one thread holds, innermost last.
    private final class Held {
        var levels: [LockLevel] = []
    }

    private static let key: pthread_key_t = {
        var key = pthread_key_t()
        pthread_key_create(&key) { raw in Unmanaged<Held>.fromOpaque(raw).release() }
        return key
    }()

    private static var held: Held {
        if let raw = pthread_getspecific(key) { return Unmanaged<Held>.fromOpaque(raw).takeUnretainedValue() }
        let fresh = Held()
        pthread_setspecific(key, Unmanaged.passRetained(fresh).toOpaque())
        return fresh
    }

    /// About to take a lock of `level`: fails the process if a lock held comes at or after it.
    @inline(__always)
    public static func willTake(_ level: LockLevel) {
        #if DEBUG
        let h = held
        if let inner = h.levels.last, inner.rank >= level.rank {
            inversion(taking: level, holding: h.levels)
        }
        h.levels.append(level)
        #endif
    }

    /// A lock was taken without waiting (`try`): it cannot deadlock, so it is not checked,
    /// but what is taken under it is.
    @inline(__always)
    public static func took(_ level: LockLevel) {
        #if DEBUG
        held.levels.append(level)
        #endif
    }

    /// A lock of `level` was let go.
    @inline(__always)
    public static func released(_ level: LockLevel) {
        #if DEBUG
        let h = held
        if let i = h.levels.lastIndex(where: { $0.rank == level.rank && $0.name == level.name }) { h.levels.remove(at: i) }
        #endif
    }

    /// The levels this thread holds (tests).
    public static var heldLevels: [LockLevel] { held.levels }

    private static func inversion(taking level: LockLevel, holding: [LockLevel]) -> Never {
        let message = "storefs: lock order violated: taking \(level) while holding "
            + holding.map(\.description).joined(separator: ", ") + " (docs/architecture.md, \"Threads and locks\")\n"
        _ = message.withCString { write(2, $0, strlen($0)) }
        fatalError(message)
    }
}

/// A `Mutex` with its place in the lock order.
public struct OrderedMutex<Value: ~Copyable>: ~Copyable, Sendable {
    private let mutex: Mutex<Value>
    public let level: LockLevel

    public init(_ level: LockLevel, _ value: consuming sending Value) {
        self.level = level
        mutex = Mutex(value)
    }

    public borrowing func withLock<Result: ~Copyable, E: Error>(
        _ body: (inout sending Value) throws(E) -> sending Result
    ) throws(E) -> sending Result {
        LockOrder.willTake(level)
        defer { LockOrder.released(level) }
        return try mutex.withLock(body)
    }
}

/// An `NSLock` with its place in the lock order.
public final class OrderedLock: @unchecked Sendable {
    private let lock = NSLock()
    public let level: LockLevel

    public init(_ level: LockLevel) { self.level = level }

    public func lock() {
        LockOrder.willTake(level)
        lock.lock()
    }

    /// Takes the lock if it is free; true if taken (then `unlock` it).
    public func `try`() -> Bool {
        guard lock.try() else { return false }
        LockOrder.took(level)
        return true
    }

    public func unlock() {
        lock.unlock()
        LockOrder.released(level)
    }

    public func withLock<T, E: Error>(_ body: () throws(E) -> T) throws(E) -> T {
        self.lock()
        defer { unlock() }
        return try body()
    }
}

/// An `NSCondition` with its place in the lock order. Waiting lets the lock go and takes it
/// back; the order is checked when it is first taken.
public final class OrderedCondition: @unchecked Sendable {
    private let condition = NSCondition()
    public let level: LockLevel

    public init(_ level: LockLevel) { self.level = level }

    public func lock() {
        LockOrder.willTake(level)
        condition.lock()
    }

    public func unlock() {
        condition.unlock()
        LockOrder.released(level)
    }

    public func wait() { condition.wait() }

    /// False when `date` passed first.
    @discardableResult
    public func wait(until date: Date) -> Bool { condition.wait(until: date) }

    public func signal() { condition.signal() }

    public func broadcast() { condition.broadcast() }
}
