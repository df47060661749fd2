from teacher_server.cli import main

main()
