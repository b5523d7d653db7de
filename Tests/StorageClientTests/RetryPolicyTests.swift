import Synchronization
import Testing
@testable import StorageClient

/// How many tries one operation gets: `attempts` against a bucket that answers nothing, up to
/// twice that while the bucket answers other requests (docs/security.md, "Time bounds").
@Suite struct RetryPolicyTests {
    let policy = RetryPolicy(attempts: 5, firstDelay: 0.001, maxDelay: 0.002, budget: 10)
    let fault = StorageError(.retryLimitExceeded, "503 from the test", httpStatus: 503)

    /// What one run did: its tries, and the error it ended with (nil: it succeeded).
    func run(failures: Int, othersAnswer: Bool) -> (tries: Int, error: StorageError?) {
        let answers = AnswerCount()
        var tries = 0
        do throws(StorageError) {
            try policy.run(answered: answers) { _ throws(StorageError) in
                tries += 1
                if othersAnswer { answers.note() }  // another operation's answer meanwhile
                if tries <= failures { throw fault }
            }
            return (tries, nil)
        } catch {
            return (tries, error)
        }
    }

    /// A try that fails once its caller was interrupted (the timeout and the INTERRUPT came
    /// together) ends the operation as cancelled, never as an outage's error, its last try too.
    @Test func aLastTryFailingAfterTheCallerWasInterruptedIsCancelled() {
        let interrupted = Atomic<Bool>(false)
        var tries = 0
        do throws(StorageError) {
            try RetryPolicy(attempts: 1, budget: 10).run(isCancelled: { interrupted.load(ordering: .relaxed) }) { _ throws(StorageError) in
                tries += 1
                interrupted.store(true, ordering: .relaxed)
                throw StorageError(.retryLimitExceeded, "no answer in time")
            }
            Issue.record("the run succeeded")
        } catch {
            #expect(error.code == .cancelled)
            #expect(tries == 1)
        }
    }

    /// One unlucky request of a flaky server (6 faults in a row) while other reads succeed:
    /// its seventh try gets the bytes, not EIO.
    @Test func aRequestFailingWhileOthersAreAnsweredKeepsTrying() {
        let (tries, error) = run(failures: 6, othersAnswer: true)
        #expect(error == nil)
        #expect(tries == 7)
    }

    /// Nothing else answered: the bucket may be down, and the operation fails after its
    /// `attempts` as before, an outage for `BucketHealth`.
    @Test func aLoneFailingRequestStopsAtItsAttemptsAndSaysNothingAnswered() {
        let (tries, error) = run(failures: 100, othersAnswer: false)
        #expect(tries == 5)
        #expect(error?.code == .retryLimitExceeded)
        #expect(error?.answeredOthers == false)
    }

    /// Others answered but this request never succeeds: twice `attempts`, then an error that
    /// says the bucket answered others (no outage is assumed from it).
    @Test func aRequestThatNeverSucceedsWhileOthersDoStopsAtTwiceItsAttempts() {
        let (tries, error) = run(failures: 100, othersAnswer: true)
        #expect(tries == 10)
        #expect(error?.code == .retryLimitExceeded)
        #expect(error?.answeredOthers == true)
    }

    /// Only answers that say the server serves requests count: a 503 or 429 elsewhere is the
    /// same trouble, not proof of a working bucket.
    @Test(arguments: [(200, true), (206, true), (404, true), (403, true), (412, true),
                      (429, false), (408, false), (500, false), (503, false)])
    func whichAnswersSayTheServerServesRequests(status: Int, serves: Bool) {
        #expect(StorageError.servesRequests(status) == serves)
    }
}
