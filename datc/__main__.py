from datc.train import main

main()
